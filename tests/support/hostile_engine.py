"""A HOSTILE engine: a small real HTTP server that answers like an SGLang engine everywhere but `/generate`,
where it gives one chosen bad reply (the peers of issue 24: a broken or malicious server given with
`--rollout-external-engine-addrs`), or stalls (issue 37: `drip` sends a reply's head and then a byte every
0.1 s; `wedge` answers nothing at all — /health included — from its first `/generate` on, as a stopped or
wedged server whose kernel still accepts connections; `hold` answers every route, /health included, but never
finishes a `/generate`, as a scheduler that lost its requests; `noload` never acknowledges
`/update_weights_from_disk` nor finishes a `/generate`, as an engine stuck loading weights). A real engine cannot be made to do these on demand, so
this one does, over real sockets; everything else in the tests around it is real.

Owns its listener and handlers (asyncio's server; `serve()` until cancelled). Run it in-process with
`await task_group.start(HostileEngine(mode).run)` or as a process: `python -m tests.support.hostile_engine
MODE PORT` (prints `ready` once listening). `GET /hostile_stats` answers how many `/generate` it served.
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Callable
from typing import Any

import anyio
import anyio.abc

HUGE_BYTES = 300 << 20  # streamed in 1 MiB chunks: this server never holds more than one
DEPTH = 100_000


def _reply(ids: list[Any], logprobs: list[Any], finish: Any = None) -> dict[str, Any]:
    return {"text": "x", "output_ids": ids,
            "meta_info": {"id": "h", "finish_reason": finish or {"type": "length", "length": len(ids)},
                          "prompt_tokens": 3, "completion_tokens": len(ids), "cached_tokens": 0,
                          "weight_version": "default",
                          "output_token_logprobs": [[lp, tok, None] for lp, tok in zip(logprobs, ids, strict=False)]}}


#: each bad reply (one per prompt of the request; the raw modes answer the whole body)
BAD_REPLIES: dict[str, Callable[[], dict[str, Any]]] = {
    "mismatch": lambda: _reply([5, 6, 7], [-0.1, -0.2]),
    "empty": lambda: _reply([], []),
    "oov": lambda: _reply([5, 1_000_000], [-0.1, -0.2]),
    "unhashable_finish": lambda: _reply([5], [-0.1], finish={"type": ["stop"]}),
    "float_ids": lambda: _reply([6.5, 7.0], [-0.1, -0.2]),
    "bool_ids": lambda: _reply([True], [-0.1]),
}
RAW_MODES = ("deep", "huge", "nan_logprob", "inf_logprob", "not_json")
BAD_MODES = (*BAD_REPLIES, *RAW_MODES)
#: the stalls (see the module's docstring)
STALL_MODES = ("drip", "wedge", "hold")
#: the modes that never answer some routes while answering all others
HELD: dict[str, tuple[str, ...]] = {"hold": ("/generate",), "noload": ("/generate", "/update_weights_from_disk")}
#: cycle: each /generate gets the next bad mode in turn; deep_error: HTTP 500 with a body nested 100k deep
MODES = (*BAD_MODES, "cycle", "deep_error", *STALL_MODES, "noload")


class HostileEngine:
    def __init__(self, mode: str, port: int = 0) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, not {mode!r}")
        self.mode = mode
        self.port = port
        self.generated = 0
        self.wedged = False
        #: requests `hold` / `noload` left unanswered
        self.held = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def run(self, *, task_status: anyio.abc.TaskStatus[HostileEngine] = anyio.TASK_STATUS_IGNORED) -> None:
        # Handlers are never cancelled (asyncio logs a cancelled connection callback as an error): shutdown
        # closes their connections, and each handler returns.
        handlers: dict[asyncio.Task[Any], asyncio.StreamWriter] = {}

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            task = asyncio.current_task()
            assert task is not None
            handlers[task] = writer
            try:
                await self._serve(reader, writer)
            except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
                pass  # the client hung up (it refused the reply half-way): that is the point
            finally:
                handlers.pop(task, None)
                writer.close()

        server = await asyncio.start_server(handle, "127.0.0.1", self.port)
        try:
            self.port = int(server.sockets[0].getsockname()[1])
            task_status.started(self)
            await anyio.sleep_forever()
        finally:
            server.close()
            for writer in list(handlers.values()):
                writer.close()
            with anyio.CancelScope(shield=True):
                await asyncio.gather(*handlers, return_exceptions=True)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            path = lines[0].split(" ")[1].split("?", 1)[0]
            headers = {k.strip().lower(): v.strip() for k, v in (ln.split(":", 1) for ln in lines[1:] if ":" in ln)}
            body = await reader.readexactly(int(headers.get("content-length", "0")))
            if self.wedged or (path == "/generate" and self.mode == "wedge"):
                self.wedged = True
                self.generated += path == "/generate"
                await reader.read()  # nothing answered; returns when the client hangs up or the server closes
                return
            if path in HELD.get(self.mode, ()):
                self.generated += path == "/generate"
                self.held += 1
                await reader.read()  # this one is never answered; returns when the client hangs up
                return
            if path == "/generate" and self.mode == "drip":
                self.generated += 1
                data = json.dumps(_reply([5], [-0.1])).encode()
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
                             % len(data))
                for byte in data:
                    await writer.drain()
                    await asyncio.sleep(0.1)
                    writer.write(bytes([byte]))
                continue
            if path == "/generate":
                self.generated += 1
                await self._generate(json.loads(body or b"{}"), writer)
                if writer.is_closing():
                    return
            else:
                self._answer(writer, 200, json.dumps(self._info(path)).encode())
            await writer.drain()

    def _info(self, path: str) -> Any:
        if path == "/hostile_stats":
            return {"generated": self.generated, "mode": self.mode}
        if path in ("/get_weight_version",):
            return {"weight_version": "default"}
        if path in ("/model_info", "/get_model_info", "/server_info", "/get_server_info"):
            return {"model_path": "hostile", "tokenizer_path": "hostile", "weight_version": "default",
                    "is_generation": True}
        return {"success": True, "message": ""}

    @staticmethod
    def _answer(writer: asyncio.StreamWriter, status: int, data: bytes) -> None:
        writer.write(b"HTTP/1.1 %d Whatever\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
                     % (status, len(data)) + data)

    async def _generate(self, request: dict[str, Any], writer: asyncio.StreamWriter) -> None:
        mode = BAD_MODES[(self.generated - 1) % len(BAD_MODES)] if self.mode == "cycle" else self.mode
        ids = request.get("input_ids")
        prompts = len(ids) if isinstance(ids, list) and ids and isinstance(ids[0], list) else None
        if mode == "deep_error":
            self._answer(writer, 500, b'{"error": ' + b"[" * DEPTH + b"]" * DEPTH + b"}")
            return
        if mode == "huge":  # chunked, no length declared: only reading it shows how large it is
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n")
            chunk = b"1" * (1 << 20)
            writer.write(b'%x\r\n{"text": "\r\n' % len(b'{"text": "'))
            for _ in range(HUGE_BYTES // len(chunk)):
                writer.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                await writer.drain()
            writer.write(b'2\r\n"}\r\n0\r\n\r\n')
            return
        if mode == "deep":
            data = b"[" * DEPTH + b"]" * DEPTH
        elif mode == "not_json":
            data = b'{"text": "x", "output_ids": [1,'
        elif mode in ("nan_logprob", "inf_logprob"):  # NaN is not JSON (json.dumps writes it); -1e999 is, out of range
            one = json.dumps(_reply([5], [-0.125])).replace("-0.125", "NaN" if mode == "nan_logprob" else "-1e999")
            data = (one if prompts is None else "[" + ",".join([one] * prompts) + "]").encode()
        else:
            make = BAD_REPLIES[mode]
            data = json.dumps(make() if prompts is None else [make() for _ in range(prompts)]).encode()
        if request.get("stream"):  # SGLang's server-sent events: the bad reply as one chunk, then [DONE]
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n"
                         b"data: " + data + b"\n\ndata: [DONE]\n\n")
            await writer.drain()
            writer.close()
            return
        self._answer(writer, 200, data)


async def _main(mode: str, port: int) -> None:
    async with anyio.create_task_group() as group:
        engine = await group.start(HostileEngine(mode, port).run)
        print(f"ready {engine.port}", flush=True)


if __name__ == "__main__":
    anyio.run(_main, sys.argv[1], int(sys.argv[2]))
