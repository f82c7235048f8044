"""Anthropic Messages reply shapes for a finished turn, whole or as SSE events, with no engine state.

Owns `message` (a `Message`: text and `tool_use` blocks, `stop_reason`, `usage`) and `message_events` (its SSE
events — `message_start`, `content_block_start`, `content_block_delta` with `text_delta` / `input_json_delta`,
`content_block_stop`, `message_delta`, `message_stop`, each as `event: NAME` + `data: {...}`) from a stream of text
deltas ending in the finished `Turn`. The engine feeds it the deltas as the model writes them; the session server
(`coordinator.sessions.wire_formats`) the whole text as one delta.

Invariant: `stop_reason` is `tool_use` when the turn holds a call of an offered tool, else `stop_sequence` (with
`stop_sequence` set) when a requested stop string ended it, `max_tokens` when the length did, `end_turn`
otherwise; the deltas of a stream concatenate to the whole reply's text.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator

from workers.boundary.json_input import JsonObject
from workers.engine.anthropic_protocol import MessagesSpec
from workers.engine.finished_turns import Turn


def stop_reason(turn: Turn, spec: MessagesSpec) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a finished turn."""
    if turn.calls:
        return "tool_use", None
    if turn.finish == "length":
        return "max_tokens", None
    if turn.finish == "stop" and isinstance(turn.matched, str) and turn.matched in spec.stop_sequences:
        return "stop_sequence", turn.matched
    return "end_turn", None


def usage(turn: Turn) -> dict[str, int]:
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
    content: list[JsonObject] = []
    if turn.text or not turn.calls:
        content.append({"type": "text", "text": turn.text})
    content += tool_blocks(turn)
    reason, sequence = stop_reason(turn, spec)
    body: JsonObject = {
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


def event(name: str, data: JsonObject) -> str:
    return f"event: {name}\ndata: {json.dumps({'type': name, **data})}\n\n"


async def message_events(spec: MessagesSpec, message_id: str, input_tokens: int,
                         items: AsyncIterator[str | Turn]) -> AsyncIterator[str]:
    """The SSE events of one message: `items` are its text deltas, then the finished turn."""
    start = {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": spec.model,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {"input_tokens": input_tokens, "output_tokens": 0},
    }
    yield event("message_start", {"message": start})
    index, text_open = 0, False
    async for item in items:
        if isinstance(item, str):
            if not text_open:
                yield event("content_block_start", {"index": index, "content_block": {"type": "text", "text": ""}})
                text_open = True
            yield event("content_block_delta", {"index": index, "delta": {"type": "text_delta", "text": item}})
            continue
        turn = item
        if not text_open and not turn.calls:  # the whole reply's content: one (empty) text block
            yield event("content_block_start", {"index": index, "content_block": {"type": "text", "text": ""}})
            text_open = True
        if text_open:
            yield event("content_block_stop", {"index": index})
            index += 1
        for block in tool_blocks(turn):
            yield event("content_block_start", {"index": index, "content_block": {**block, "input": {}}})
            partial = json.dumps(block["input"])
            yield event("content_block_delta",
                        {"index": index, "delta": {"type": "input_json_delta", "partial_json": partial}})
            yield event("content_block_stop", {"index": index})
            index += 1
        reason, sequence = stop_reason(turn, spec)
        yield event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": sequence},
                                      "usage": usage(turn)})
        yield event("message_stop", {})
