"""OpenAI Responses request bodies (`client.responses.create`) → the engine's OpenAI chat body: one generation
core, another wire format.

Owns the field mapping only (no I/O): `responses_request` validates a `/v1/responses` body and returns the
`/v1/chat/completions` body the chat route validates, renders with the chat template and runs, plus what the
reply needs (`ResponsesSpec`).

Mapping: `instructions` → a leading system message; `input` as a string → one user message; as a list of
items: messages (`role` user / system / developer — as system — / assistant; content a string or `input_text`
/ `output_text` parts), `function_call` items → the preceding assistant message's OpenAI `tool_calls` (a new
assistant message when there is none), `function_call_output` items → `tool` messages, `reasoning` items
dropped; `tools` (function tools) → OpenAI function tools given to the chat template; `max_output_tokens` →
`max_tokens`; `temperature`, `top_p` as they are; SGLang's `return_meta_info` (with the output logprobs), `seed`
and its ResponsesRequest sampling extras (`stop`, `top_k`, `min_p`, `repetition_penalty`, `frequency_penalty`,
`presence_penalty`) through.

Invariants: every rejection is a `RequestError` naming the field (SGLang's 400 `ErrorResponse`);
`previous_response_id` and `conversation` are refused (the engine stores no responses: send the whole input),
as are non-function tools, forced `tool_choice` (it needs constrained decoding), structured `text.format`, and
non-text content — never silently dropped — except, with `images=True` (the session server on a vision-language
policy, and the engine's own route on a vision-language model, docs/vlm.md), `input_image` parts, which become
OpenAI `image_url` parts in their place.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from workers.boundary.json_input import JsonObject, JsonValue
from workers.engine.sampling_params import RequestError, show

_ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
_TEXT_PARTS = ("input_text", "output_text", "text")
#: the image parts SGLang's Responses route turns into chat `image_url` parts (`serving_responses.py`)
_IMAGE_PARTS = ("input_image", "image_url")


@dataclass
class ResponsesSpec:
    chat_body: dict[str, Any]
    model: str
    stream: bool = False
    tools: list[dict[str, Any]] = field(
        default_factory=list
    )  # as the request gave them (echoed in the reply)
    tool_names: set[str] = field(default_factory=set)
    tool_choice: str = "auto"
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    meta_info: bool = False


def _text(content: JsonValue, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(f"{where} must be a string or a list of text parts")
    texts = []
    for index, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            raise RequestError(
                f"{where}[{index}]: only text parts are supported by the rayless engine, got {show(kind)}"
            )
        texts.append(part["text"])
    return "\n".join(texts)


def _parts(content: JsonValue, where: str) -> str | list[JsonObject]:
    """A message's content with its `input_image` parts as OpenAI `image_url` parts, in order among its text
    parts; without an image part, the joined text (as `_text`)."""
    if not isinstance(content, list) or not any(
            isinstance(part, dict) and part.get("type") in _IMAGE_PARTS for part in content):
        return _text(content, where)
    parts: list[JsonObject] = []
    for index, part in enumerate(content):
        if isinstance(part, dict) and part.get("type") in _IMAGE_PARTS:
            url = part.get("image_url")
            url = url.get("url") if isinstance(url, dict) else url  # a string, or {"url": ...} as SGLang takes too
            if not isinstance(url, str):
                raise RequestError(f"{where}[{index}]: an input_image part needs a string image_url (a data URL; "
                                   "file_id is not supported: the rayless session server stores no files)")
            parts.append({"type": "image_url", "image_url": {"url": url}})
        else:
            parts.append({"type": "text", "text": _text([part], f"{where}[{index}]")})
    return parts


def _items(items: JsonValue, images: bool = False) -> list[JsonObject]:
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise RequestError("'input' must be a string or a non-empty list of input items")
    messages: list[dict[str, Any]] = []
    for index, item in enumerate(items):
        where = f"input[{index}]"
        if not isinstance(item, dict):
            raise RequestError(f"{where} must be an object")
        kind = item.get("type", "message")
        if kind == "message":
            role = _ROLES.get(item.get("role"))  # type: ignore[arg-type]
            if role is None:
                raise RequestError(f"{where}.role must be user, system, developer or assistant")
            content = item.get("content")
            taken = (_parts(content, f"{where}.content") if images and role != "assistant"
                     else _text(content, f"{where}.content"))
            messages.append({"role": role, "content": taken})
        elif kind == "function_call":
            name, arguments = item.get("name"), item.get("arguments")
            if (
                not isinstance(name, str)
                or not isinstance(arguments, str)
                or not isinstance(item.get("call_id"), str)
            ):
                raise RequestError(f"{where}: a function_call needs string 'call_id', 'name' and 'arguments'")
            call = {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": name, "arguments": arguments},
            }
            if messages and messages[-1]["role"] == "assistant":
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise RequestError(f"{where}: a function_call_output needs a string 'call_id'")
            output = _text(item.get("output"), f"{where}.output")
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": output})
        elif kind == "reasoning":
            continue  # the model's earlier reasoning is not rendered back
        else:
            raise RequestError(
                f"{where}: input items of type {show(kind)} are not supported by the rayless engine"
            )
    return messages


def _tools(body: JsonObject, spec: ResponsesSpec) -> list[JsonObject] | None:
    tools = body.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise RequestError("'tools' must be a list")
    converted = []
    for index, tool in enumerate(tools):
        if (
            not isinstance(tool, dict)
            or tool.get("type") != "function"
            or not isinstance(tool.get("name"), str)
        ):
            kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
            raise RequestError(
                f"tools[{index}]: only function tools with a string 'name' are supported by the rayless engine, "
                f"got {show(kind)}"
            )
        parameters = tool.get("parameters") or {"type": "object", "properties": {}}
        converted.append(
            {
                "type": "function",
                "function": {
                    "name": tool["name"],
                    "description": tool.get("description") or "",
                    "parameters": parameters,
                },
            }
        )
    spec.tools = tools
    return converted


def responses_request(body: JsonValue, default_model: str, *, images: bool = False) -> ResponsesSpec:
    """A /v1/responses body as the chat body that runs it; `images`: a non-assistant message's `input_image`
    parts become `image_url` parts (the session server on a vision-language policy; the engine serves none)."""
    if not isinstance(body, dict):
        raise RequestError("request body must be a JSON object")
    for key in ("previous_response_id", "conversation"):
        if body.get(key) is not None:
            raise RequestError(
                f"'{key}' is not supported: the rayless engine stores no responses, send the whole input"
            )
    text = body.get("text")
    if text is not None:
        fmt = text.get("format") if isinstance(text, dict) else None
        if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != "text"):
            raise RequestError(
                "'text.format' other than text needs constrained decoding, which the rayless engine does not do"
            )
    model = body.get("model", default_model)
    if not isinstance(model, str):
        raise RequestError("'model' must be a string")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise RequestError("'instructions' must be a string")
    messages = ([{"role": "system", "content": instructions}] if instructions else []) + _items(
        body.get("input"), images
    )
    chat: dict[str, Any] = {"model": model, "messages": messages}
    spec = ResponsesSpec(chat_body=chat, model=model, instructions=instructions)
    tools = _tools(body, spec)
    choice = body.get("tool_choice", "auto")
    if choice not in ("auto", "none"):
        raise RequestError(
            f"'tool_choice' {show(choice)}: only 'auto' and 'none' are supported (forcing a tool needs constrained "
            "decoding, which the rayless engine does not do)"
        )
    spec.tool_choice = choice
    if tools:
        chat["tools"], chat["tool_choice"] = tools, choice
        if choice != "none":
            spec.tool_names = {tool["function"]["name"] for tool in tools}
    limit = body.get("max_output_tokens")
    if limit is not None:
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise RequestError(f"'max_output_tokens' must be a positive integer, got {show(limit)}")
        chat["max_tokens"] = spec.max_output_tokens = limit
    # SGLang's ResponsesRequest sampling extras too (stop, top_k, min_p, the penalties): the chat route checks them
    for key in ("temperature", "top_p", "seed", "stop", "top_k", "min_p", "repetition_penalty", "frequency_penalty",
                "presence_penalty"):
        if body.get(key) is not None:
            chat[key] = body[key]
    spec.temperature, spec.top_p = body.get("temperature"), body.get("top_p")
    stream, meta = body.get("stream", False), body.get("return_meta_info", False)
    if not isinstance(stream, bool) or not isinstance(meta, bool):
        raise RequestError("'stream' and 'return_meta_info' must be booleans")
    if stream and meta:
        raise RequestError("return_meta_info is not supported with streaming: set stream=false")
    chat["stream"] = spec.stream = stream
    if meta:
        chat["return_meta_info"] = chat["logprobs"] = spec.meta_info = True
    return spec
