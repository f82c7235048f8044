"""The engine's Anthropic Messages endpoints: `POST /v1/messages` (whole or streamed) and `POST
/v1/messages/count_tokens`, as the official `anthropic` SDK calls them and SGLang serves them.

Owns the handlers and the reply shapes: a body is mapped to a chat body (`anthropic_protocol`), run as one
assistant turn by the chat route's core (`assistant_turns`), and answered as an Anthropic `Message` (text and
`tool_use` blocks, `stop_reason`, `usage`) or as its SSE events (`message_start`, `content_block_start`,
`content_block_delta` — `text_delta` / `input_json_delta` — `content_block_stop`, `message_delta`,
`message_stop`, each as `event: NAME` + `data: {...}`).

Invariants: every rejection is Anthropic's error shape (`{"type": "error", "error": {"type", "message"}}`)
with a 4xx status, decided before anything joins the batch; the API key and the body limits are the engine's
gates, as on every route (`--api-key` as `Authorization: Bearer`: the SDK's `auth_token`); `stop_reason` is
`tool_use` when the turn holds a call of an offered tool, else `stop_sequence` (with `stop_sequence` set) when
a requested stop string ended it, `max_tokens` when the length did, `end_turn` otherwise.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from workers.boundary.json_input import JsonObject
from workers.engine.anthropic_protocol import MessagesSpec, messages_request
from workers.engine.assistant_turns import Started, Turn, TurnRunner
from workers.engine.http_input import read_json
from workers.engine.openai_routes import EngineCore
from workers.engine.sampling_params import RequestError
from workers.engine.sequences import MemoryReleasedError


def anthropic_error(message: str, status: int = 400, kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse({"type": "error", "error": {"type": kind, "message": message}}, status_code=status)


def stop_reason(turn: Turn, spec: MessagesSpec) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a finished turn."""
    if turn.calls:
        return "tool_use", None
    if turn.finish == "length":
        return "max_tokens", None
    if turn.finish == "stop" and isinstance(turn.matched, str) and turn.matched in spec.stop_sequences:
        return "stop_sequence", turn.matched
    return "end_turn", None


def usage(turn: Turn) -> JsonObject:
    return {
        "input_tokens": turn.prompt_tokens,
        "output_tokens": turn.output_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
    }


def tool_blocks(turn: Turn) -> list[JsonObject]:
    return [
        {
            "type": "tool_use",
            "id": f"toolu_{uuid.uuid4().hex[:24]}",
            "name": call.name,
            "input": call.arguments,
        }
        for call in turn.calls
    ]


def message(turn: Turn, spec: MessagesSpec) -> JsonObject:
    content: list[dict[str, Any]] = []
    if turn.text or not turn.calls:
        content.append({"type": "text", "text": turn.text})
    content += tool_blocks(turn)
    reason, sequence = stop_reason(turn, spec)
    body: dict[str, Any] = {
        "id": f"msg_{turn.id}",
        "type": "message",
        "role": "assistant",
        "model": spec.model,
        "content": content,
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": usage(turn),
    }
    if turn.meta_info is not None:
        body["meta_info"] = turn.meta_info  # SGLang's extension: token in / token out, as the chat route's
    return body


def _event(name: str, data: JsonObject) -> str:
    return f"event: {name}\ndata: {json.dumps({'type': name, **data})}\n\n"


class AnthropicRoutes:
    """Route handlers over one engine."""

    def __init__(self, server: EngineCore) -> None:
        self.server = server
        self.turns = TurnRunner(server)

    def routes(self) -> list[Route]:
        return [
            Route("/v1/messages", self.messages, methods=["POST"]),
            Route("/v1/messages/count_tokens", self.count_tokens, methods=["POST"]),
        ]

    async def count_tokens(self, request: Request) -> Response:
        try:
            body = await read_json(request, self.server.args.max_request_bytes)
            spec = messages_request(body, self.server.model_path, counting=True)
            return JSONResponse({"input_tokens": await self.turns.count(spec.chat_body)})
        except RequestError as exc:
            return anthropic_error(str(exc))

    async def messages(self, request: Request) -> Response:
        try:
            body = await read_json(request, self.server.args.max_request_bytes)
            spec = messages_request(body, self.server.model_path)
            started = await self.turns.start(
                spec.chat_body, prefill=spec.prefill, known=spec.tool_names, stops=spec.stop_sequences
            )
        except RequestError as exc:
            return anthropic_error(str(exc))
        except MemoryReleasedError as exc:
            return anthropic_error(str(exc), 503, "overloaded_error")
        if spec.stream:
            return StreamingResponse(self._events(spec, started), media_type="text/event-stream")
        turn = await self.turns.whole(request, started, meta_info=spec.meta_info)
        return JSONResponse(message(turn, spec))

    async def _events(self, spec: MessagesSpec, started: Started) -> AsyncIterator[str]:
        try:
            start = {
                "id": f"msg_{started.seq.public_id}",
                "type": "message",
                "role": "assistant",
                "model": spec.model,
                "content": [],
                "stop_reason": None,
                "stop_sequence": None,
                "usage": {"input_tokens": len(started.seq.prompt_ids), "output_tokens": 0},
            }
            yield _event("message_start", {"message": start})
            index, text_open = 0, False
            async for item in self.turns.deltas(started):
                if isinstance(item, str):
                    if not text_open:
                        yield _event(
                            "content_block_start",
                            {"index": index, "content_block": {"type": "text", "text": ""}},
                        )
                        text_open = True
                    yield _event(
                        "content_block_delta", {"index": index, "delta": {"type": "text_delta", "text": item}}
                    )
                    continue
                turn = item
                if not text_open and not turn.calls:  # the whole reply's content: one (empty) text block
                    yield _event(
                        "content_block_start", {"index": index, "content_block": {"type": "text", "text": ""}}
                    )
                    text_open = True
                if text_open:
                    yield _event("content_block_stop", {"index": index})
                    index += 1
                for block in tool_blocks(turn):
                    yield _event(
                        "content_block_start", {"index": index, "content_block": {**block, "input": {}}}
                    )
                    partial = json.dumps(block["input"])
                    yield _event(
                        "content_block_delta",
                        {"index": index, "delta": {"type": "input_json_delta", "partial_json": partial}},
                    )
                    yield _event("content_block_stop", {"index": index})
                    index += 1
                reason, sequence = stop_reason(turn, spec)
                yield _event(
                    "message_delta",
                    {"delta": {"stop_reason": reason, "stop_sequence": sequence}, "usage": usage(turn)},
                )
                yield _event("message_stop", {})
        finally:
            self.turns.abort(started)
