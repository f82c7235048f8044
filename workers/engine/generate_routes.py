"""`/generate` over HTTP: a request's sequences submitted, waited for or streamed, and rendered as SGLang does.

Owns the handler and the response shapes (`text`, `output_ids`, `meta_info` with SGLang's logprob triples),
and the SSE stream (`data: {...}` chunks, `stream_interval`, then `data: [DONE]`). The request itself is
validated by the engine's `build` (`generate_request`) before anything runs.

Invariant: a client that disconnects, waiting or mid-stream, aborts its sequences, so nothing keeps
generating for nobody. A released engine answers 503 MemoryReleased (`replies.released_error`).
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, Protocol

import anyio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from workers.boundary.json_input import JsonObject
from workers.engine.http_input import read_json
from workers.engine.replies import error, released_error
from workers.engine.sampling import RequestError
from workers.engine.sequences import MemoryReleasedError, RequestGroup, Seq

if TYPE_CHECKING:
    from workers.engine.args import EngineArgs
    from workers.engine.runner import ModelRunner
    from workers.engine.scheduler import Scheduler


class GenerateCore(Protocol):
    """What /generate uses of the engine (`workers.engine.server.EngineServer`)."""

    args: EngineArgs
    runner: ModelRunner
    scheduler: Scheduler

    @property
    def weight_version(self) -> str: ...

    async def build(self, body: JsonObject) -> tuple[list[Seq], bool, RequestGroup]: ...


class GenerateRoutes:
    """The /generate handler and the rendering of sequences, over one engine."""

    def __init__(self, server: GenerateCore) -> None:
        self.server = server

    def routes(self) -> list[Route]:
        return [Route("/generate", self.generate, methods=["GET", "POST"])]

    def _token_text(self, token: int, with_text: bool) -> str | None:
        return self.server.runner.tokenizer.decode([token]) if with_text else None

    def render(self, seq: Seq, *, with_text: bool, final: bool) -> JsonObject:
        scheduler = self.server.scheduler
        if final or seq.finished:
            text = scheduler.text_of(seq)
        else:
            text = self.server.runner.tokenizer.decode(
                seq.output_ids, skip_special_tokens=seq.params.skip_special_tokens
            )
        meta: dict[str, Any] = {
            "id": seq.public_id,
            "finish_reason": seq.finish_reason,
            "prompt_tokens": len(seq.prompt_ids),
            "completion_tokens": len(seq.output_ids),
            "cached_tokens": 0,
            "weight_version": seq.weight_version if seq.finished else self.server.weight_version,
            "e2e_latency": seq.latency
            if seq.latency is not None
            else time.perf_counter() - seq.group.created,
        }
        if seq.return_logprob:
            meta["input_token_logprobs"] = [
                [lp, token, self._token_text(token, with_text)] for lp, token in (seq.input_logprobs or [])
            ]
            meta["output_token_logprobs"] = [
                [lp, token, self._token_text(token, with_text)]
                for lp, token in zip(seq.output_logprobs, seq.output_ids, strict=True)
            ]
            if seq.top_logprobs_num:
                meta["input_top_logprobs"] = [
                    [[lp, t, self._token_text(t, with_text)] for lp, t in entry]
                    for entry in (seq.input_top_logprobs or [])
                ]
                meta["output_top_logprobs"] = [
                    [[lp, t, self._token_text(t, with_text)] for lp, t in entry]
                    for entry in seq.output_top_logprobs
                ]
            if seq.token_ids_logprob or seq.position_token_ids is not None:  # the asked ids' logprobs
                meta["input_token_ids_logprobs"] = [
                    [[lp, t, self._token_text(t, with_text)] for lp, t in entry]
                    for entry in (seq.input_token_ids_logprobs or [])
                ]
                meta["output_token_ids_logprobs"] = [
                    [[lp, t, self._token_text(t, with_text)] for lp, t in entry]
                    for entry in seq.output_token_ids_logprobs
                ]
        return {"text": text, "output_ids": list(seq.output_ids), "meta_info": meta}

    async def generate(self, request: Request) -> Response:
        try:
            body = await read_json(request, self.server.args.max_request_bytes)
            seqs, single, group = await self.server.build(body)
            await self.server.scheduler.submit(group)
        except RequestError as exc:
            return error(str(exc))
        except MemoryReleasedError as exc:
            return released_error(exc)
        with_text = bool(body.get("return_text_in_logprobs", False))
        if group.stream:
            return StreamingResponse(
                self._stream(group, seqs, single=single, with_text=with_text), media_type="text/event-stream"
            )
        await self.wait_or_disconnect(request, group)
        rendered = [self.render(seq, with_text=with_text, final=True) for seq in seqs]
        return JSONResponse(rendered[0] if single else rendered)

    async def wait_or_disconnect(self, request: Request, group: RequestGroup) -> None:
        """Wait for the group; if the client goes away first, abort its sequences."""

        async def watch_disconnect() -> None:
            while True:
                message = await request.receive()
                if message["type"] == "http.disconnect":
                    self.server.scheduler.abort_group(group, "client disconnected")
                    return

        async with anyio.create_task_group() as tg:
            tg.start_soon(watch_disconnect)
            await group.wait_finished()
            tg.cancel_scope.cancel()

    async def _stream(
        self, group: RequestGroup, seqs: list[Seq], *, single: bool, with_text: bool
    ) -> AsyncIterator[str]:
        sent: dict[int, tuple[int, bool]] = {}
        try:
            while True:
                group.changed = anyio.Event()
                for seq in seqs:
                    state = (len(seq.output_ids), seq.finished)
                    if sent.get(seq.index, (0, False)) == state:
                        continue  # nothing new (SGLang sends no chunk before the first token)
                    interval = seq.params.stream_interval
                    if interval and not seq.finished and state[0] % interval:
                        continue  # stream_interval: a chunk every `interval` tokens, and the last one
                    sent[seq.index] = state
                    chunk = self.render(seq, with_text=with_text, final=seq.finished)
                    if not single:
                        chunk["index"] = seq.index
                    yield f"data: {json.dumps(chunk)}\n\n"
                if group.finished:
                    break
                await group.changed.wait()
            yield "data: [DONE]\n\n"
        finally:
            # Reached with sequences still running only when the client went away mid-stream.
            self.server.scheduler.abort_group(group, "client disconnected")
