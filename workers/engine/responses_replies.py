"""OpenAI Responses reply shapes for a finished turn, whole or as SSE events, with no engine state.

Owns `response_object` / `output` (a `Response`: a `message` output item with `output_text`, one `function_call`
item per parsed call, `usage`) and `response_events` (its SSE events: `response.created`, `response.in_progress`,
`response.output_item.added`, `response.content_part.added`, `response.output_text.delta` / `.done`,
`response.content_part.done`, `response.function_call_arguments.delta` / `.done`, `response.output_item.done`,
then `response.completed` or `response.incomplete`, each numbered by `sequence_number`) from a stream of text
deltas ending in the finished `Turn`. The engine feeds it the deltas as the model writes them; the session server
(`coordinator.sessions.wire_formats`) the whole text as one delta.

Invariant: a turn cut by the length is `status: incomplete` with `incomplete_details.reason: max_output_tokens`;
nothing is stored (`store` is answered false); the deltas of a stream concatenate to the output text.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator

from workers.boundary.json_input import JsonObject, JsonValue
from workers.engine.finished_turns import Turn
from workers.engine.responses_protocol import ResponsesSpec


def usage(turn: Turn) -> JsonObject:
    return {
        "input_tokens": turn.prompt_tokens,
        "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
        "output_tokens": turn.output_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": turn.prompt_tokens + turn.output_tokens,
    }


def message_item(item_id: str, text: str, status: str) -> JsonObject:
    content = (
        [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
        if status != "in_progress"
        else []
    )
    return {"type": "message", "id": item_id, "role": "assistant", "status": status, "content": content}


def call_items(turn: Turn) -> list[JsonObject]:
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
    body: JsonObject = {
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
        "usage": usage(turn) if turn is not None else None,
    }
    if turn is not None and turn.meta_info is not None:
        body["meta_info"] = turn.meta_info  # SGLang's extension: token in / token out, as the chat route's
    return body


def output(turn: Turn) -> list[JsonObject]:
    items = []
    if turn.text or not turn.calls:
        items.append(message_item(f"msg_{turn.id}", turn.text, "completed"))
    return items + call_items(turn)


async def response_events(spec: ResponsesSpec, response_id: str, created: int, item_id: str,
                          items: AsyncIterator[str | Turn]) -> AsyncIterator[str]:
    """The SSE events of one response: `items` are its text deltas, then the finished turn."""
    number = 0

    def event(kind: str, **data: JsonValue) -> str:
        nonlocal number
        number += 1
        return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': number - 1, **data})}\n\n"

    def opening() -> list[str]:
        """The message item's and its text part's opening events (output index 0: text comes before calls)."""
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        return [
            event("response.output_item.added", output_index=0, item=message_item(item_id, "", "in_progress")),
            event("response.content_part.added", item_id=item_id, output_index=0, content_index=0, part=part),
        ]

    yield event("response.created", response=response_object(spec, response_id, created, None, []))
    yield event("response.in_progress", response=response_object(spec, response_id, created, None, []))
    text, opened = "", False
    done_items: list[JsonObject] = []
    async for item in items:
        if isinstance(item, str):
            if not opened:
                for line in opening():
                    yield line
                opened = True
            text += item
            yield event("response.output_text.delta", item_id=item_id, output_index=0, content_index=0,
                        delta=item, logprobs=[])
            continue
        turn = item
        if not opened and not turn.calls:
            for line in opening():
                yield line
            opened = True
        if opened:
            done = message_item(item_id, text, "completed")
            yield event("response.output_text.done", item_id=item_id, output_index=0, content_index=0, text=text,
                        logprobs=[])
            yield event("response.content_part.done", item_id=item_id, output_index=0, content_index=0,
                        part=done["content"][0])
            yield event("response.output_item.done", output_index=0, item=done)
            done_items.append(done)
        for call in call_items(turn):
            index = len(done_items)
            yield event("response.output_item.added", output_index=index,
                        item={**call, "arguments": "", "status": "in_progress"})
            yield event("response.function_call_arguments.delta", item_id=call["id"], output_index=index,
                        delta=call["arguments"])
            yield event("response.function_call_arguments.done", item_id=call["id"], output_index=index,
                        name=call["name"], arguments=call["arguments"])
            yield event("response.output_item.done", output_index=index, item=call)
            done_items.append(call)
        final = response_object(spec, response_id, created, turn, done_items)
        kind = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
        yield event(kind, response=final)
