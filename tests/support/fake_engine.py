"""A FAKE engine: an in-process HTTP responder speaking the few SGLang endpoints the FT code uses.

Used only for failures a real engine cannot be made to show on demand and deterministically: a
`/health_generate` that hangs while `/metrics` keeps moving (slow, not hung), an engine that reports a stale
weight version after a load (pin violation), a listener that refuses connections and comes back (external
engine outage), and 16 instant responders for the probe benchmark. Everything else is tested against the real
CPU engine.

Owns its server and connection handlers; `run()` serves until cancelled and closes them on every exit path
(no process is started).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import anyio
import anyio.abc


class FakeEngine:
    """Knobs: `health` ("ok" | "hang"), `progressing` (metrics counter grows per read), `stale_version`
    (reported instead of the loaded one), `serving` (False drops every connection without an answer, counted
    in `dropped`), `hold_updates()` (/update_weights_from_disk waits until `release_updates()`)."""

    def __init__(self) -> None:
        self.health = "ok"
        self.progressing = False
        self.counter = 0.0
        self.weight_version = "0"
        self.stale_version: str | None = None
        self.requests: dict[str, int] = {}
        self.dropped = 0
        self._updates = anyio.Event()
        self._updates.set()
        self.port: int | None = None
        self._serving = anyio.Event()
        self._serving.set()
        self._closing = anyio.Event()

    @property
    def url(self) -> str:
        assert self.port is not None
        return f"http://127.0.0.1:{self.port}"

    def stop_serving(self) -> None:
        self._serving = anyio.Event()

    def start_serving(self) -> None:
        self._serving.set()

    def hold_updates(self) -> None:
        self._updates = anyio.Event()

    def release_updates(self) -> None:
        self._updates.set()

    async def run(self, *, task_status: anyio.abc.TaskStatus[FakeEngine] = anyio.TASK_STATUS_IGNORED) -> None:
        # asyncio's own server, not anyio's listener: anyio's accept is a cancellable `sock_accept` future, and
        # on Python 3.11 a connection arriving just as that future is cancelled at teardown (the monitor probes
        # every 0.1 s) makes the loop report InvalidStateError. The suite pins the asyncio backend. While "not
        # serving", every connection is dropped without an answer.
        # Handlers are never cancelled (asyncio logs a cancelled connection callback as an error): shutdown
        # closes their connections and releases a hanging /health_generate, and each handler returns.
        handlers: dict[asyncio.Task[Any], asyncio.StreamWriter] = {}
        self._closing = anyio.Event()

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            task = asyncio.current_task()
            assert task is not None
            handlers[task] = writer
            try:
                await self._handle(reader, writer)
            finally:
                handlers.pop(task, None)
                writer.close()

        server = await asyncio.start_server(handle, "127.0.0.1", self.port or 0)
        try:
            self.port = int(server.sockets[0].getsockname()[1])
            task_status.started(self)
            await anyio.sleep_forever()
        finally:
            server.close()
            self._closing.set()
            self._updates.set()
            with anyio.CancelScope(shield=True):
                # a connection accepted just before close() starts its handler on the next loop pass: let it,
                # then close and await every handler until none is left (an unawaited one leaks its transport)
                await asyncio.sleep(0)
                while handlers:
                    for writer in list(handlers.values()):
                        writer.close()
                    await asyncio.gather(*handlers, return_exceptions=True)
                await server.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            if not self._serving.is_set():
                self.dropped += 1
                return  # gone: the connection is closed without an answer
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, OSError):
                return
            if not self._serving.is_set():
                self.dropped += 1
                return
            lines = head.decode().split("\r\n")
            method, target, _ = lines[0].split(" ", 2)
            headers = {k.strip().lower(): v.strip() for k, v in (ln.split(":", 1) for ln in lines[1:] if ":" in ln)}
            length = int(headers.get("content-length", "0"))
            try:
                body = await reader.readexactly(length) if length else b""
            except (asyncio.IncompleteReadError, OSError):
                return
            path = target.split("?", 1)[0]
            self.requests[path] = self.requests.get(path, 0) + 1
            status, payload = await self._route(method, path, body)
            if writer.is_closing():
                return
            data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
            kind = b"text/plain" if isinstance(payload, bytes) else b"application/json"
            writer.write(b"HTTP/1.1 %d OK\r\nContent-Type: %s\r\nContent-Length: %d\r\n\r\n"
                         % (status, kind, len(data)) + data)
            try:
                await writer.drain()
            except OSError:
                return

    async def _route(self, method: str, path: str, body: bytes) -> tuple[int, Any]:
        request = json.loads(body) if body else {}
        if path == "/health_generate":
            if self.health == "hang":
                await self._closing.wait()  # hangs until the fake shuts down
                return 503, b""
            return 200, b""
        if path == "/health":
            return 200, b""
        if path == "/metrics":
            if self.progressing:
                self.counter += 1
            return 200, (f"sglang:num_requests_total{{model_name=\"fake\"}} {self.counter}\n"
                         "sglang:generation_tokens_total{model_name=\"fake\"} 0.0\n").encode()
        if path in ("/get_weight_version", "/model_info"):
            return 200, {"weight_version": self.stale_version or self.weight_version, "model_path": "fake"}
        if path == "/update_weights_from_disk":
            await self._updates.wait()
            self.weight_version = str(request.get("weight_version", self.weight_version))
            return 200, {"success": True, "message": "ok", "num_paused_requests": 0}
        if path == "/generate":
            return 200, {"text": "a", "output_ids": [5], "meta_info": {
                "id": "x", "finish_reason": {"type": "length", "length": 1}, "prompt_tokens": 1,
                "completion_tokens": 1, "cached_tokens": 0, "weight_version": self.stale_version or self.weight_version,
                "output_token_logprobs": [[-0.5, 5, None]]}}
        if path in ("/pause_generation", "/continue_generation", "/abort_request", "/flush_cache"):
            return 200, {"success": True}
        return 404, {"error": {"message": f"no route {path}"}}
