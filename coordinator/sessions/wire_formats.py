"""The session server's three wire formats over one session core: OpenAI chat completions, Anthropic Messages
(`/v1/messages`) and OpenAI Responses (`/v1/responses`).

Owns the mapping between a Messages or Responses body and the chat request the session records (the engine's
own protocol modules: `workers.engine.anthropic_protocol`, `workers.engine.responses_protocol`), and between the
engine's chat reply and the format's reply or SSE events (the engine's own shapes: `workers.engine
.anthropic_replies`, `workers.engine.responses_replies`). Tool calls are read from the model's text with the
Qwen/Hermes `<tool_call>` parser the engine uses for these formats (`workers.engine.tool_call_text`), so a
reply's `tool_use` blocks / `function_call` items are what the model wrote.

Invariants: the turn a format records is the chat turn (same prompt ids, output ids and logprobs: one core);
the assistant message stored in the session's tree is the OpenAI form the client's next request maps back to
(text plus `tool_calls`), so a harness that sends its history back continues the same branch; a stream is the
whole answer as one text delta followed by the closing events (the session needs the complete turn first, as
miles' session server fakes chat streaming); a final assistant message (a prefill) is refused: a session's
prompts end with the generation prompt.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from workers.boundary.json_input import JsonObject, JsonValue
from workers.engine.anthropic_protocol import MessagesSpec, messages_request
from workers.engine.anthropic_replies import message, message_events
from workers.engine.finished_turns import Turn
from workers.engine.responses_protocol import ResponsesSpec, responses_request
from workers.engine.responses_replies import output, response_events, response_object
from workers.engine.sampling_params import RequestError
from workers.engine.tool_call_text import assistant_turn

MESSAGES_PATH = "v1/messages"
RESPONSES_PATH = "v1/responses"


class FormatError(ValueError):
    """A body the format refuses (answered 400 in the format's error shape)."""


@dataclass
class FormatCall:
    """A Messages or Responses request as the session runs it: the chat body, the tools whose calls the reply
    parses, and how the finished turn is answered."""

    chat_body: JsonObject
    tool_names: set[str]
    stream: bool
    meta_info: bool
    answer: Callable[[Turn], bytes]
    events: Callable[[Turn], AsyncIterator[str]]


def _finished(turn: Turn) -> AsyncIterator[str | Turn]:
    async def items() -> AsyncIterator[str | Turn]:
        if turn.text:
            yield turn.text
        yield turn
    return items()


def messages_call(body: JsonValue, model: str, images: bool = False) -> FormatCall:
    """`images`: the policy is a vision-language model, so image blocks become image_url parts (docs/vlm.md)."""
    try:
        spec: MessagesSpec = messages_request(body, model, images=images)
    except RequestError as error:
        raise FormatError(str(error)) from None
    if spec.prefill:
        raise FormatError("a session's prompts end with the generation prompt: a final assistant message (a "
                          "prefill) cannot be continued here")
    chat = dict(spec.chat_body)
    chat.pop("stream", None)
    return FormatCall(
        chat_body=chat, tool_names=spec.tool_names, stream=spec.stream, meta_info=spec.meta_info,
        answer=lambda turn: json.dumps(message(turn, spec)).encode(),
        events=lambda turn: message_events(spec, f"msg_{turn.id}", turn.prompt_tokens, _finished(turn)))


def responses_call(body: JsonValue, model: str, images: bool = False) -> FormatCall:
    """`images`: as `messages_call`, for input_image parts."""
    try:
        spec: ResponsesSpec = responses_request(body, model, images=images)
    except RequestError as error:
        raise FormatError(str(error)) from None
    chat = dict(spec.chat_body)
    chat.pop("stream", None)
    created = int(time.time())
    return FormatCall(
        chat_body=chat, tool_names=spec.tool_names, stream=spec.stream, meta_info=spec.meta_info,
        answer=lambda turn: json.dumps(response_object(spec, f"resp_{turn.id}", created, turn, output(turn))).encode(),
        events=lambda turn: response_events(spec, f"resp_{turn.id}", created, f"msg_{turn.id}", _finished(turn)))


def finished_turn(response: JsonObject, tool_names: set[str], *, meta_info: bool) -> Turn:
    """The engine's chat reply (already checked by the session) as a finished turn of the structured formats."""
    choice = response["choices"][0]
    content = choice["message"].get("content") or ""
    text, calls = assistant_turn("", str(content), tool_names)
    usage = response.get("usage") or {}
    meta = choice.get("meta_info")
    return Turn(id=str(response.get("id") or "session"), text=text, calls=calls, finish=choice.get("finish_reason"),
                matched=choice.get("matched_stop"), prompt_tokens=int(usage.get("prompt_tokens", 0)),
                output_tokens=int(usage.get("completion_tokens", 0)), meta_info=meta if meta_info else None)


def stored_reply(turn: Turn) -> JsonObject:
    """The assistant message a structured turn is stored as: the OpenAI form its client's next request maps to."""
    reply: JsonObject = {"role": "assistant", "content": turn.text}
    if turn.calls:
        reply["tool_calls"] = [{"id": f"call_{index}", "type": "function",
                                "function": {"name": call.name, "arguments": json.dumps(call.arguments)}}
                               for index, call in enumerate(turn.calls)]
    return reply


def anthropic_error(message_text: str) -> bytes:
    return json.dumps({"type": "error", "error": {"type": "invalid_request_error", "message": message_text}}).encode()
