"""The engine's OpenAI Responses endpoint: `POST /v1/responses` (whole or streamed), as the official `openai`
SDK's `client.responses.create` calls it and parses it.

Owns the handler and the reply shapes: a body is mapped to a chat body (`responses_protocol`), run as one
assistant turn by the chat route's core (`assistant_turns`), and answered as a `Response` (a `message` output
item with `output_text`, one `function_call` item per parsed call, `usage`) or as its SSE events
(`response.created`, `response.in_progress`, `response.output_item.added`, `response.content_part.added`,
`response.output_text.delta` / `.done`, `response.content_part.done`, `response.function_call_arguments.delta`
/ `.done`, `response.output_item.done`, then `response.completed` or `response.incomplete`), each numbered by
`sequence_number`.

Invariants: every rejection is SGLang's 4xx `ErrorResponse`, as on the other `/v1` routes, decided before
anything joins the batch; the API key and body limits are the engine's gates; a turn cut by the length is
`status: incomplete` with `incomplete_details.reason: max_output_tokens`; nothing is stored (`store` is
answered false).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from workers.engine.assistant_turns import Started, TurnRunner
from workers.engine.http_input import read_json
from workers.engine.openai_routes import EngineCore, openai_error
from workers.engine.responses_protocol import ResponsesSpec, responses_request
from workers.engine.responses_replies import output, response_events, response_object
from workers.engine.sampling_params import RequestError
from workers.engine.sequences import MemoryReleasedError


class ResponsesRoutes:
    """Route handlers over one engine."""

    def __init__(self, server: EngineCore) -> None:
        self.server = server
        self.turns = TurnRunner(server)

    def routes(self) -> list[Route]:
        return [Route("/v1/responses", self.responses, methods=["POST"])]

    async def responses(self, request: Request) -> Response:
        try:
            body = await read_json(request, self.server.args.max_request_bytes)
            spec = responses_request(body, self.server.model_path, images=self.turns.vlm)
            started = await self.turns.start(spec.chat_body, prefill="", known=spec.tool_names)
        except RequestError as exc:
            return openai_error(str(exc))
        except MemoryReleasedError as exc:
            return openai_error(str(exc), 503, "MemoryReleased", released=exc.released)
        response_id, created = f"resp_{started.seq.public_id}", int(time.time())
        if spec.stream:
            return StreamingResponse(
                self._events(spec, started, response_id, created), media_type="text/event-stream"
            )
        turn = await self.turns.whole(request, started, meta_info=spec.meta_info)
        return JSONResponse(response_object(spec, response_id, created, turn, output(turn)))

    async def _events(
        self, spec: ResponsesSpec, started: Started, response_id: str, created: int
    ) -> AsyncIterator[str]:
        try:
            events = response_events(spec, response_id, created, f"msg_{started.seq.public_id}",
                                     self.turns.deltas(started))
            async for item in events:
                yield item
        finally:
            self.turns.abort(started)
