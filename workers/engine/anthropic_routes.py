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

from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from workers.engine.anthropic_protocol import MessagesSpec, messages_request
from workers.engine.anthropic_replies import message, message_events
from workers.engine.assistant_turns import Started, TurnRunner
from workers.engine.http_input import read_json
from workers.engine.openai_routes import EngineCore
from workers.engine.sampling_params import RequestError
from workers.engine.sequences import MemoryReleasedError


def anthropic_error(message: str, status: int = 400, kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse({"type": "error", "error": {"type": kind, "message": message}}, status_code=status)


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
            spec = messages_request(body, self.server.model_path, counting=True, images=self.turns.vlm)
            return JSONResponse({"input_tokens": await self.turns.count(spec.chat_body)})
        except RequestError as exc:
            return anthropic_error(str(exc))

    async def messages(self, request: Request) -> Response:
        try:
            body = await read_json(request, self.server.args.max_request_bytes)
            spec = messages_request(body, self.server.model_path, images=self.turns.vlm)
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
            events = message_events(spec, f"msg_{started.seq.public_id}", len(started.seq.prompt_ids),
                                    self.turns.deltas(started))
            async for item in events:
                yield item
        finally:
            self.turns.abort(started)
