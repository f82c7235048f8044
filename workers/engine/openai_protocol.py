"""OpenAI request bodies → the engine's /generate body, as SGLang 0.5's `ChatCompletionRequest` /
`CompletionRequest` and their `to_sampling_params` map them.

Owns the field mapping only (no I/O): `chat_request` and `completion_request` validate an OpenAI body and
return a `GenerateBody` — the /generate body the server's own validator then checks with the same rules,
bounds and 400s as `/generate` — plus what the response needs (model name, logprobs wanted, stream options).

Invariants: every rejection is a `RequestError` naming the field (400 in SGLang's `ErrorResponse` shape);
fields SGLang's pydantic models ignore (unknown top-level keys) are ignored here too; a sampling field the
engine does not honour (constrained decoding, response_format json) is refused by the sampling validator,
not silently dropped. Chat prompts are rendered by the model's chat template (or given as `input_ids`,
which SGLang uses verbatim and which miles' session server sends).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from workers.boundary.json_input import JsonObject, JsonValue
from workers.engine.sampling_params import RequestError, show

MAX_TOP_LOGPROBS = 20  # OpenAI's bound on top_logprobs (chat) / logprobs (completions)

# Chat/completions field -> SGLang sampling_params key (SGLang's to_sampling_params).
_SAMPLING_MAP = {
    "temperature": "temperature",
    "min_tokens": "min_new_tokens",
    "stop": "stop",
    "stop_token_ids": "stop_token_ids",
    "stop_regex": "stop_regex",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "repetition_penalty": "repetition_penalty",
    "regex": "regex",
    "ebnf": "ebnf",
    "json_schema": "json_schema",
    "n": "n",
    "no_stop_trim": "no_stop_trim",
    "ignore_eos": "ignore_eos",
    "skip_special_tokens": "skip_special_tokens",
    "logit_bias": "logit_bias",
    "custom_params": "custom_params",
    "seed": "sampling_seed",
    "watermark": "watermark",
}


@dataclass
class GenerateBody:
    """A validated OpenAI request, as the /generate body it becomes plus what its response needs."""

    body: dict[str, Any]
    model: str
    chat: bool = False
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    return_meta_info: bool = False
    echo: bool = False
    #: chat: the messages and template arguments, rendered to `input_ids` by the server (off the loop)
    messages: list[dict[str, Any]] | None = None
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    #: chat on a vision-language model: the messages' image URLs in order (SGLang's `image_data` for the prompt);
    #: each one's part is `{"type": "image"}` in `messages`, where the template writes its placeholder
    image_urls: list[str] = field(default_factory=list)


def _bool(body: JsonObject, key: str, default: bool = False) -> bool:
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise RequestError(f"'{key}' must be true or false, got {show(value)}")
    return value


def _optional_int(body: JsonObject, key: str, low: int, high: int | None = None) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, int)
        or value < low
        or (high is not None and value > high)
    ):
        bound = f"[{low}, {high}]" if high is not None else f">= {low}"
        raise RequestError(f"'{key}' must be an integer {bound}, got {show(value)}")
    return value


def _model(body: JsonObject, default: str) -> str:
    model = body.get("model", default)
    if model is None:
        return default
    if not isinstance(model, str):
        raise RequestError(f"'model' must be a string, got {show(model)}")
    return model


def _sampling(body: JsonObject, max_tokens: int | None) -> JsonObject:
    params: dict[str, Any] = {"max_new_tokens": max_tokens}
    for key, target in _SAMPLING_MAP.items():
        if body.get(key) is not None:
            params[target] = body[key]
    response_format = body.get("response_format")
    if response_format is not None:
        if not isinstance(response_format, dict) or not isinstance(response_format.get("type"), str):
            raise RequestError("'response_format' must be an object with a 'type'")
        if response_format["type"] != "text":  # json_object / json_schema / structural_tag: a grammar
            params["json_schema"] = json.dumps(response_format.get("json_schema") or {"type": "object"})
    return params


def _stream_options(body: JsonObject, stream: bool) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, dict):
        raise RequestError("'stream_options' must be an object")
    if not stream:
        raise RequestError("'stream_options' is only allowed when 'stream' is true")
    return _bool(options, "include_usage")


def _common(body: JsonObject) -> None:
    if not isinstance(body, dict):
        raise RequestError("request body must be a JSON object")
    if body.get("lora_path") is not None:
        raise RequestError("'lora_path': LoRA adapters are not supported by the rayless engine")
    _optional_int(body, "n", 1)
    if body.get("rid") is not None and not isinstance(body["rid"], str):
        raise RequestError("'rid' must be a string")


def image_url_of(part: JsonObject, where: str) -> str:
    """An `image_url` part's URL (`{"url": ...}` or the string itself, as SGLang takes both); shared by the
    engine's chat route and the session server."""
    value = part.get("image_url")
    url = value.get("url") if isinstance(value, dict) else value
    if not isinstance(url, str) or not url:
        raise RequestError(f"{where}: an image_url part needs image_url.url, a non-empty string")
    return url


def _message_content(message: JsonObject, index: int, images: list[str] | None = None) -> JsonValue:
    """SGLang's 'string' content format: text parts joined with newlines; other parts refused. With `images` (a
    vision-language model's chat) a content holding `image_url` parts stays a list — text parts and one
    `{"type": "image"}` per image, where the model's template writes the image's placeholder, as SGLang's
    'openai' content format — and the images' URLs are appended to `images` in order."""
    content = message.get("content")
    if content is None or isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(f"messages[{index}].content must be a string, a list of parts or null")
    texts = []
    parts: list[JsonObject] = []
    found: list[str] = []
    for position, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind == "image_url" and images is not None:
            found.append(image_url_of(part, f"messages[{index}].content[{position}]"))  # type: ignore[arg-type]
            parts.append({"type": "image"})
            continue
        if not isinstance(part, dict) or kind != "text" or not isinstance(part.get("text"), str):
            why = (": images need a vision-language model, and this engine's model is not one"
                   if kind == "image_url" else "")
            raise RequestError(
                f"messages[{index}].content: only text parts are supported by the rayless engine, got {show(kind)}"
                f"{why}"
            )
        texts.append(part["text"])
        parts.append({"type": "text", "text": part["text"]})
    if found:
        images.extend(found)  # type: ignore[union-attr]
        return parts
    return "\n".join(texts)


def normalise_messages(messages: JsonValue, images: list[str] | None = None) -> list[JsonObject]:
    """The messages as the chat template sees them (content flattened to a string, None kept); with `images`,
    a message holding images keeps its parts and their URLs are collected (`_message_content`)."""
    if not isinstance(messages, list) or not messages:
        raise RequestError("'messages' must be a non-empty list of message objects")
    normalised = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise RequestError(f"messages[{index}] must be an object with a string 'role'")
        item = {key: value for key, value in message.items() if value is not None}
        item["content"] = _message_content(message, index, images)
        if item["content"] is None:
            item["content"] = ""  # SGLang renders a null content (a tool-call turn) as ""
        normalised.append(item)
    return normalised


def chat_request(body: JsonObject, default_model: str, *, images: bool = False) -> GenerateBody:
    """A /v1/chat/completions body as a generate body; `messages` left for the server to render unless
    `input_ids` are given (then the messages are not rendered, as in SGLang). `images`: the engine's model is a
    vision-language model, so `image_url` parts are taken (`GenerateBody.image_urls`)."""
    _common(body)
    stream = _bool(body, "stream")
    logprobs = _bool(body, "logprobs")
    top = _optional_int(body, "top_logprobs", 0, MAX_TOP_LOGPROBS) or 0
    if top and not logprobs:
        raise RequestError("'top_logprobs' requires 'logprobs': true")
    meta = _bool(body, "return_meta_info")
    if stream and meta:
        raise RequestError(
            "return_meta_info is not supported with streaming. Please set stream=false when using "
            "return_meta_info=true."
        )
    max_tokens = _optional_int(body, "max_completion_tokens", 0)
    if max_tokens is None:
        max_tokens = _optional_int(body, "max_tokens", 0)
    generate: dict[str, Any] = {
        "sampling_params": _sampling(body, max_tokens),
        "return_logprob": logprobs,
        "top_logprobs_num": top,
        "stream": stream,
    }
    if body.get("rid") is not None:
        generate["rid"] = body["rid"]
    spaces = True
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None:
        if not isinstance(kwargs, dict):
            raise RequestError("'chat_template_kwargs' must be an object")
        spaces = bool(kwargs.get("spaces_between_special_tokens", True))
    generate["sampling_params"]["spaces_between_special_tokens"] = spaces
    result = GenerateBody(
        body=generate,
        model=_model(body, default_model),
        chat=True,
        stream=stream,
        include_usage=_stream_options(body, stream),
        logprobs=logprobs,
        top_logprobs=top,
        return_meta_info=meta,
    )
    input_ids = body.get("input_ids")
    if input_ids is not None:
        if not isinstance(input_ids, list) or (input_ids and isinstance(input_ids[0], list)):
            raise RequestError("'input_ids' must be a list of integers")
        generate["input_ids"] = input_ids
        if body.get("image_data") is not None:  # a VLM's images for those ids (the session server sends them)
            generate["image_data"] = body["image_data"]
        return result
    result.messages = normalise_messages(body.get("messages"), result.image_urls if images else None)
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise RequestError("'tools' must be a list")
    continue_final = _bool(body, "continue_final_message")
    result.template_kwargs = {
        **(kwargs or {}),
        "add_generation_prompt": not continue_final,
        "continue_final_message": continue_final,
    }
    if tools is not None and body.get("tool_choice") != "none":
        result.template_kwargs["tools"] = [t.get("function", t) if isinstance(t, dict) else t for t in tools]
    return result


def completion_request(body: JsonObject, default_model: str) -> GenerateBody:
    """A /v1/completions body as a generate body (text or token-id prompts, one or a batch)."""
    _common(body)
    stream = _bool(body, "stream")
    prompt = body.get("prompt")
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and isinstance(prompt[0], str)):
        key = "text"
    elif isinstance(prompt, list) and prompt and (isinstance(prompt[0], (int, list))):
        key = "input_ids"
    else:
        raise RequestError("'prompt' must be a string, a list of strings, or token ids")
    if body.get("suffix") is not None:
        raise RequestError("'suffix' is not supported (SGLang does not support it either)")
    best_of = _optional_int(body, "best_of", 1)
    if best_of is not None and best_of != (body.get("n") or 1):
        raise RequestError("'best_of' other than n is not supported")
    top = _optional_int(body, "logprobs", 0, MAX_TOP_LOGPROBS)
    echo = _bool(body, "echo")
    max_tokens = _optional_int(body, "max_tokens", 0)
    generate: dict[str, Any] = {
        key: prompt,
        "sampling_params": _sampling(body, 16 if "max_tokens" not in body else max_tokens),
        "return_logprob": top is not None,
        "top_logprobs_num": top or 0,
        "stream": stream,
    }
    if echo and top is not None:
        generate["logprob_start_len"] = 0  # the prompt's own logprobs are echoed too
    if body.get("rid") is not None:
        generate["rid"] = body["rid"]
    return GenerateBody(
        body=generate,
        model=_model(body, default_model),
        stream=stream,
        include_usage=_stream_options(body, stream),
        logprobs=top is not None,
        top_logprobs=top or 0,
        echo=echo,
    )
