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

import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from workers.boundary.json_input import JsonObject, JsonValue
from workers.engine.assistant_turns import Started, Turn, TurnRunner
from workers.engine.http_input import read_json
from workers.engine.openai_routes import EngineCore, openai_error
from workers.engine.responses_protocol import ResponsesSpec, responses_request
from workers.engine.sampling_params import RequestError
from workers.engine.sequences import MemoryReleasedError


def _usage(turn: Turn) -> JsonObject:
    return {
        "input_tokens": turn.prompt_tokens,
        "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
        "output_tokens": turn.output_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": turn.prompt_tokens + turn.output_tokens,
    }


def _message_item(item_id: str, text: str, status: str) -> JsonObject:
    content = (
        [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
        if status != "in_progress"
        else []
    )
    return {"type": "message", "id": item_id, "role": "assistant", "status": status, "content": content}


def _call_items(turn: Turn) -> list[JsonObject]:
    return [
        {
            "type": "function_call",
            "id": f"fc_{uuid.uuid4().hex[:24]}",
            "call_id": f"call_{uuid.uuid4().hex[:24]}",
            "name": call.name,
            "arguments": json.dumps(call.arguments),
            "status": "completed",
        }
        for call in turn.calls
    ]


def response_object(
    spec: ResponsesSpec, response_id: str, created: int, turn: Turn | None, output: list[JsonObject]
) -> JsonObject:
    """The `Response`; `turn` None: still in progress."""
    status, incomplete = "in_progress", None
    if turn is not None:
        status = "completed"
        if turn.finish == "length" and not turn.calls:
            status, incomplete = "incomplete", {"reason": "max_output_tokens"}
    body: dict[str, Any] = {
        "id": response_id,
        "object": "response",
        "created_at": created,
        "status": status,
        "error": None,
        "incomplete_details": incomplete,
        "instructions": spec.instructions,
        "max_output_tokens": spec.max_output_tokens,
        "model": spec.model,
        "output": output,
        "parallel_tool_calls": True,
        "temperature": spec.temperature,
        "top_p": spec.top_p,
        "tool_choice": spec.tool_choice,
        "tools": spec.tools,
        "store": False,
        "metadata": {},
        "usage": _usage(turn) if turn is not None else None,
    }
    if turn is not None and turn.meta_info is not None:
        body["meta_info"] = turn.meta_info  # SGLang's extension: token in / token out, as the chat route's
    return body


def _output(turn: Turn) -> list[JsonObject]:
    output = []
    if turn.text or not turn.calls:
        output.append(_message_item(f"msg_{turn.id}", turn.text, "completed"))
    return output + _call_items(turn)


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
            spec = responses_request(body, self.server.model_path)
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
        return JSONResponse(response_object(spec, response_id, created, turn, _output(turn)))

    async def _events(
        self, spec: ResponsesSpec, started: Started, response_id: str, created: int
    ) -> AsyncIterator[str]:
        number = 0

        def event(kind: str, **data: JsonValue) -> str:
            nonlocal number
            number += 1
            return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': number - 1, **data})}\n\n"

        try:
            yield event("response.created", response=response_object(spec, response_id, created, None, []))
            yield event(
                "response.in_progress", response=response_object(spec, response_id, created, None, [])
            )
            item_id, text, opened = f"msg_{started.seq.public_id}", "", False
            output: list[dict[str, Any]] = []
            async for item in self.turns.deltas(started):
                if isinstance(item, str):
                    if not opened:
                        for opening in _opening(event, item_id):
                            yield opening
                        opened = True
                    text += item
                    yield event(
                        "response.output_text.delta",
                        item_id=item_id,
                        output_index=0,
                        content_index=0,
                        delta=item,
                        logprobs=[],
                    )
                    continue
                turn = item
                if not opened and not turn.calls:
                    for opening in _opening(event, item_id):
                        yield opening
                    opened = True
                if opened:
                    done = _message_item(item_id, text, "completed")
                    part = done["content"][0]
                    yield event(
                        "response.output_text.done",
                        item_id=item_id,
                        output_index=0,
                        content_index=0,
                        text=text,
                        logprobs=[],
                    )
                    yield event(
                        "response.content_part.done",
                        item_id=item_id,
                        output_index=0,
                        content_index=0,
                        part=part,
                    )
                    yield event("response.output_item.done", output_index=0, item=done)
                    output.append(done)
                for call in _call_items(turn):
                    index = len(output)
                    yield event(
                        "response.output_item.added",
                        output_index=index,
                        item={**call, "arguments": "", "status": "in_progress"},
                    )
                    yield event(
                        "response.function_call_arguments.delta",
                        item_id=call["id"],
                        output_index=index,
                        delta=call["arguments"],
                    )
                    yield event(
                        "response.function_call_arguments.done",
                        item_id=call["id"],
                        output_index=index,
                        name=call["name"],
                        arguments=call["arguments"],
                    )
                    yield event("response.output_item.done", output_index=index, item=call)
                    output.append(call)
                final = response_object(spec, response_id, created, turn, output)
                kind = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
                yield event(kind, response=final)
        finally:
            self.turns.abort(started)


def _opening(event: Callable[..., str], item_id: str) -> list[str]:
    """The message item's and its text part's opening events (output index 0: text comes before calls)."""
    part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
    return [
        event("response.output_item.added", output_index=0, item=_message_item(item_id, "", "in_progress")),
        event("response.content_part.added", item_id=item_id, output_index=0, content_index=0, part=part),
    ]
