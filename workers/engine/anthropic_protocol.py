"""Anthropic Messages request bodies → the engine's OpenAI chat body, as SGLang's Anthropic adapter
(`sglang/srt/entrypoints/anthropic/serving.py`) converts them: one generation core, another wire format.

Owns the field mapping only (no I/O): `messages_request` validates a `/v1/messages` body (or, with
`counting=True`, a `/v1/messages/count_tokens` body) and returns the `/v1/chat/completions` body the chat
route validates, renders with the chat template and runs, plus what the reply needs (`MessagesSpec`).

Mapping: `system` (a string or text blocks) → a leading system message; text blocks joined with newlines;
assistant `tool_use` blocks → the message's OpenAI `tool_calls` (arguments as JSON); user `tool_result` blocks
→ `tool` messages (`tool_call_id` = `tool_use_id`) in order; `thinking` blocks dropped (SGLang keeps none
either); `tools` → OpenAI function tools given to the chat template; `stop_sequences` → `stop`; `max_tokens`,
`temperature`, `top_p`, `top_k` as they are; a final assistant message is a prefill the model continues
(`continue_final_message`), as Anthropic's API does. SGLang extensions a client may add (`extra_body`):
`return_meta_info` (the reply's `meta_info`, with the output logprobs: token in / token out, as the chat
route), `seed`.

Images: with `images=True` (the session server on a vision-language policy, and the engine's own route on a
vision-language model, docs/vlm.md) a user message's
`image` blocks, and those of a `tool_result`'s content, become OpenAI `image_url` parts in their place among the
text parts, as SGLang's adapter does: a `base64` source as its data URL (`image/png` when no media type is given),
a `url` source as that URL (which the session refuses, naming it, and the engine takes only as `image_data`
takes a reference: it fetches nothing).

Invariants: every rejection is a `RequestError` naming the field (a 400 in Anthropic's error shape); images
(unless taken as above), documents and other non-text content are refused by name, never dropped; `tool_choice`
`any` / `tool` (which need constrained decoding) are refused, not ignored.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from workers.boundary.json_input import JsonObject, JsonValue
from workers.engine.sampling_params import RequestError, show

_ROLES = ("user", "assistant")


@dataclass
class MessagesSpec:
    """What the reply needs besides the generated sequence."""

    chat_body: dict[str, Any]
    model: str
    stream: bool = False
    stop_sequences: list[str] = field(default_factory=list)
    tool_names: set[str] = field(default_factory=set)
    prefill: str = ""  # the text of a final assistant message the model continues
    meta_info: bool = False


def _text_of(blocks: list[JsonValue], where: str) -> str:
    texts = []
    for index, block in enumerate(blocks):
        if (
            not isinstance(block, dict)
            or block.get("type") != "text"
            or not isinstance(block.get("text"), str)
        ):
            kind = block.get("type") if isinstance(block, dict) else type(block).__name__
            raise RequestError(f"{where}[{index}]: expected a text block, got {show(kind)}")
        texts.append(block["text"])
    return "\n".join(texts)


def _system(body: JsonObject) -> list[JsonObject]:
    system = body.get("system")
    if system is None:
        return []
    if isinstance(system, str):
        text = system
    elif isinstance(system, list):
        text = _text_of(system, "system")
    else:
        raise RequestError("'system' must be a string or a list of text blocks")
    return [{"role": "system", "content": text}] if text else []


def _tool_result_content(block: JsonObject, where: str, images: bool) -> str | list[JsonObject]:
    """A tool_result's content: its text, or with `images` and an image block among its blocks, its text and
    image parts in order (a tool's screenshot, as SGLang's adapter passes it)."""
    content = block.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(f"{where}.content must be a string or a list of text blocks")
    if not images or not any(isinstance(item, dict) and item.get("type") == "image" for item in content):
        return _text_of(content, f"{where}.content")
    return [_image_part(item, f"{where}.content[{number}]") if isinstance(item, dict) and item.get("type") == "image"
            else {"type": "text", "text": _text_of([item], f"{where}.content[{number}]")}
            for number, item in enumerate(content)]


def _image_part(block: JsonObject, where: str) -> JsonObject:
    """An `image` block as the OpenAI `image_url` part it stands for."""
    source = block.get("source")
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "base64" and isinstance(source.get("media_type", ""), str) and isinstance(source.get("data"), str):
        url = f"data:{source.get('media_type') or 'image/png'};base64,{source['data']}"  # SGLang's default type
    elif kind == "url" and isinstance(source.get("url"), str):
        url = source["url"]
    else:
        raise RequestError(f"{where}: an image block needs a source of type base64 (with string data) or url, "
                           f"got {show(kind)}")
    return {"type": "image_url", "image_url": {"url": url}}


def _message(message: JsonValue, index: int, images: bool = False) -> list[JsonObject]:
    """One Anthropic message as the OpenAI messages it stands for (tool results become their own messages);
    `images`: a user message's image blocks as `image_url` parts (its content then a list of parts, in order)."""
    where = f"messages[{index}]"
    if not isinstance(message, dict) or message.get("role") not in _ROLES:
        raise RequestError(f"{where} must be an object with 'role' user or assistant")
    role, content = message["role"], message.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise RequestError(f"{where}.content must be a string or a list of content blocks")
    texts: list[str] = []
    parts: list[JsonObject] = []  # text and image parts in order, the content when the message holds an image
    calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    for number, block in enumerate(content):
        at = f"{where}.content[{number}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
            parts.append({"type": "text", "text": block["text"]})
        elif kind == "image" and role == "user" and images:
            parts.append(_image_part(block, at))
        elif kind == "tool_use" and role == "assistant":
            if not isinstance(block.get("name"), str) or not isinstance(block.get("input", {}), dict):
                raise RequestError(f"{at}: a tool_use block needs a string 'name' and an object 'input'")
            calls.append(
                {
                    "id": str(block.get("id") or f"toolu_{index}_{number}"),
                    "type": "function",
                    "function": {"name": block["name"], "arguments": json.dumps(block.get("input", {}))},
                }
            )
        elif kind == "tool_result" and role == "user":
            if not isinstance(block.get("tool_use_id"), str):
                raise RequestError(f"{at}: a tool_result block needs a string 'tool_use_id'")
            results.append(
                {
                    "role": "tool",
                    "tool_call_id": block["tool_use_id"],
                    "content": _tool_result_content(block, at, images),
                }
            )
        elif kind in ("thinking", "redacted_thinking"):
            continue  # the model's earlier reasoning is not rendered back, as in SGLang
        else:
            shown = kind if kind is not None else type(block).__name__
            raise RequestError(
                f"{at}: content blocks of type {show(shown)} are not supported by the rayless engine "
                f"(text, tool_use in assistant turns, tool_result in user turns)"
            )
    out: list[dict[str, Any]] = list(results)
    with_images = len(parts) > len(texts)
    if texts or calls or with_images or not results:
        item: dict[str, Any] = {"role": role, "content": parts if with_images else "\n".join(texts)}
        if calls:
            item["tool_calls"] = calls
        out.append(item)
    return out


def _tools(body: JsonObject) -> list[JsonObject] | None:
    tools = body.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise RequestError("'tools' must be a list")
    converted = []
    for index, tool in enumerate(tools):
        if not isinstance(tool, dict) or not isinstance(tool.get("name"), str):
            raise RequestError(f"tools[{index}] must be an object with a string 'name'")
        if tool.get("type") not in (None, "custom"):
            raise RequestError(
                f"tools[{index}]: server tools ({show(tool.get('type'))}) are not supported by the rayless engine"
            )
        schema = tool.get("input_schema", {"type": "object"})
        if not isinstance(schema, dict):
            raise RequestError(f"tools[{index}].input_schema must be an object")
        converted.append(
            {
                "type": "function",
                "function": {
                    "name": tool["name"],
                    "description": tool.get("description") or "",
                    "parameters": schema,
                },
            }
        )
    return converted


def _tool_choice(body: JsonObject) -> str | None:
    choice = body.get("tool_choice")
    if choice is None:
        return None
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind in ("auto", "none"):
        return kind
    raise RequestError(
        f"'tool_choice' {show(kind)}: only 'auto' and 'none' are supported (forcing a tool needs constrained "
        "decoding, which the rayless engine does not do)"
    )


def messages_request(body: JsonValue, default_model: str, *, counting: bool = False,
                     images: bool = False) -> MessagesSpec:
    """A /v1/messages body (or a count_tokens body) as the chat body that runs it (`images`: the module's
    docstring)."""
    if not isinstance(body, dict):
        raise RequestError("request body must be a JSON object")
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise RequestError("'messages' must be a non-empty list of message objects")
    messages = _system(body)
    for index, message in enumerate(raw):
        messages += _message(message, index, images)
    model = body.get("model", default_model)
    if not isinstance(model, str):
        raise RequestError("'model' must be a string")
    chat: dict[str, Any] = {"model": model, "messages": messages}
    tools = _tools(body)
    choice = _tool_choice(body)
    if tools:
        chat["tools"] = tools
        if choice is not None:
            chat["tool_choice"] = choice
    spec = MessagesSpec(chat_body=chat, model=model)
    if tools and choice != "none":
        spec.tool_names = {tool["function"]["name"] for tool in tools}
    last = raw[-1]
    if isinstance(last, dict) and last.get("role") == "assistant":
        chat["continue_final_message"] = True
        spec.prefill = messages[-1]["content"]
    if counting:
        return spec
    max_tokens = body.get("max_tokens")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise RequestError(f"'max_tokens' is required and must be a positive integer, got {show(max_tokens)}")
    chat["max_tokens"] = max_tokens
    for key in ("temperature", "top_p", "top_k", "seed"):
        if body.get(key) is not None:
            chat[key] = body[key]
    stops = body.get("stop_sequences")
    if stops is not None:
        if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
            raise RequestError("'stop_sequences' must be a list of non-empty strings")
        chat["stop"] = stops
        spec.stop_sequences = list(stops)
    stream = body.get("stream", False)
    meta = body.get("return_meta_info", False)
    if not isinstance(stream, bool) or not isinstance(meta, bool):
        raise RequestError("'stream' and 'return_meta_info' must be booleans")
    if stream and meta:
        raise RequestError("return_meta_info is not supported with streaming: set stream=false")
    chat["stream"] = spec.stream = stream
    if meta:
        chat["return_meta_info"] = chat["logprobs"] = spec.meta_info = True
    return spec
