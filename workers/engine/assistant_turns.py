"""One assistant turn run through the chat route's core, for the wire formats that return structured tool calls
(`/v1/messages`, `/v1/responses`): a chat body in; the text, the parsed tool calls, the finish and the token
counts out, whole or as a stream of text deltas.

Owns the turn's life: the chat body goes through `OpenAIRoutes.start` (the chat route's validation, chat
template, bounds, scheduler), a finished turn's text is split into text and calls (`tool_call_text`), and a
stream holds back what may be call markup until the turn ends.

Invariants: the tokens, logprobs and counts are the chat route's for the same body (one core, several wire
formats); a streamed turn's deltas concatenate to the whole turn's `text` (call markup and a stop string the
engine trims are held back until the turn shows what they are); a client that leaves mid-stream aborts its
sequence (the caller's `finally` calls `abort`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request

from workers.boundary.json_input import JsonObject
from workers.engine.finished_turns import Turn
from workers.engine.openai_protocol import chat_request
from workers.engine.openai_routes import EngineCore, OpenAIRoutes
from workers.engine.sequences import Seq
from workers.engine.tool_call_text import assistant_turn, sendable


@dataclass
class Started:
    seq: Seq
    group: Any
    prefill: str
    known: set[str]
    stops: list[str]


class TurnRunner:
    """Runs chat bodies on one engine for the structured-output routes."""

    def __init__(self, server: EngineCore) -> None:
        self.server = server
        self.chat = OpenAIRoutes(server)

    @property
    def vlm(self) -> bool:
        """The engine's model is a vision-language model: the wire formats' image blocks are taken."""
        return self.server.runner.vision_processor is not None

    async def start(
        self, chat_body: JsonObject, *, prefill: str, known: set[str], stops: list[str] | None = None
    ) -> Started:
        """Validated, rendered and submitted; `RequestError` / `MemoryReleasedError` before anything runs."""
        _spec, seqs, group = await self.chat.start(chat_body)
        return Started(seqs[0], group, prefill, known, list(stops or []))

    async def count(self, chat_body: JsonObject) -> int:
        """The prompt's token count as the chat route would render it, each image's tokens included (nothing
        runs)."""
        template = self.chat._chat_input(chat_body)  # the chat route's limits and template rule, then its render
        spec = chat_request(chat_body, self.server.model_path, images=self.vlm)
        ids = await self.chat._render_chat(spec, template)
        if spec.image_urls:
            ids = await self.server.expand_images(ids, spec.image_urls)
        return len(ids)

    def finished(self, started: Started, *, meta_info: bool) -> Turn:
        seq = started.seq
        text, calls = assistant_turn(started.prefill, self.server.scheduler.text_of(seq), started.known)
        reason = seq.finish_reason or {}
        meta = self.server.render(seq, with_text=True, final=True)["meta_info"] if meta_info else None
        return Turn(
            id=seq.public_id,
            text=text,
            calls=calls,
            finish=reason.get("type"),
            matched=reason.get("matched"),
            prompt_tokens=len(seq.prompt_ids),
            output_tokens=len(seq.output_ids),
            meta_info=meta,
        )

    async def whole(self, request: Request, started: Started, *, meta_info: bool = False) -> Turn:
        await self.server.wait_or_disconnect(request, started.group)
        return self.finished(started, meta_info=meta_info)

    async def deltas(self, started: Started) -> AsyncIterator[str | Turn]:
        """Text deltas as the model writes them, then the finished `Turn`. Call markup and possible stop strings
        are held back, so the deltas are `Turn.text` in pieces: what was held back and turned out to be text comes
        with the end of the turn."""
        tokenizer, sent = self.server.runner.tokenizer, ""
        async for seq in self.chat._changes(started.group, [started.seq]):
            if seq.finished:
                continue  # the last change (`_changes` ends with it): the rest comes from the finished text
            written = tokenizer.decode(seq.output_ids, skip_special_tokens=seq.params.skip_special_tokens)
            written = written.rstrip("\ufffd")  # hold back a character whose bytes are not all there yet
            upto = sendable(started.prefill, written, started.known, started.stops)
            if upto > len(sent) and written.startswith(sent):
                yield written[len(sent) : upto]
                sent = written[:upto]
        turn = self.finished(started, meta_info=False)
        if turn.text.startswith(sent) and len(turn.text) > len(sent):
            yield turn.text[len(sent) :]
        yield turn

    def abort(self, started: Started) -> None:
        # Reached with the sequence still running only when the client went away mid-stream.
        self.server.scheduler.abort_group(started.group, "client disconnected")
