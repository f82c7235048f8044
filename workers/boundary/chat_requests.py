"""What a chat request from a client may carry before anything renders or tokenizes it: each message's size and
whether it brings its own chat template. Shared by the engine's OpenAI routes and the session server.

Owns `MAX_MESSAGE_BYTES` (the default per-message bound), `oversized_message` (the first message whose content
is over the bound, said as a 413's message) and `request_template` (the template a request brings:
`chat_template`, or `chat_template_kwargs.chat_template`, as transformers' `apply_chat_template` takes it).

Invariant: both checks are linear in the request and allocate nothing of the size of a message (a string's
UTF-8 size is computed only when its length alone cannot decide), so a 30 MB message is refused in
milliseconds, before a tokenizer sees it.
"""

from __future__ import annotations

from typing import Any

MAX_MESSAGE_BYTES = 8 << 20  # 8 MiB of UTF-8 in one message: far beyond any context a policy is trained on


def _text_bytes(text: str, limit: int) -> int:
    """The UTF-8 size of `text` when it may be over `limit` (≤ 4 bytes a character), else its length."""
    if len(text) > limit or 4 * len(text) <= limit:
        return len(text)
    return len(text.encode("utf-8", "surrogatepass"))


def _content_bytes(content: Any, limit: int) -> int:
    """The bytes of a message's text: a string, or the text (and other string fields) of a list of parts."""
    if isinstance(content, str):
        return _text_bytes(content, limit)
    size = 0
    if isinstance(content, list):
        for part in content:
            if isinstance(part, dict):
                for value in part.values():
                    if isinstance(value, str):
                        size += _text_bytes(value, limit)
                    elif isinstance(value, dict):  # {"image_url": {"url": "data:..."}}
                        size += sum(_text_bytes(v, limit) for v in value.values() if isinstance(v, str))
            elif isinstance(part, str):
                size += _text_bytes(part, limit)
            if size > limit:
                break
    return size


def oversized_message(messages: Any, limit: int = MAX_MESSAGE_BYTES) -> str | None:
    """Why one of `messages` is over `limit` bytes (its content, reasoning or tool-call arguments), or None."""
    if not isinstance(messages, list):
        return None
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            continue
        size = _content_bytes(message.get("content"), limit)
        for key in ("reasoning_content", "name", "tool_call_id"):
            if isinstance(message.get(key), str):
                size += _text_bytes(message[key], limit)
        calls = message.get("tool_calls")
        if isinstance(calls, list):
            for call in calls:
                function = call.get("function") if isinstance(call, dict) else None
                if isinstance(function, dict):
                    size += sum(_text_bytes(v, limit) for v in function.values() if isinstance(v, str))
        if size > limit:
            return f"messages[{index}] holds more than {limit} bytes (the per-message limit)"
    return None


def request_template(body: dict[str, Any]) -> Any:
    """The chat template the request brings itself (`chat_template`, or `chat_template_kwargs.chat_template`),
    or None when it uses the model's."""
    kwargs = body.get("chat_template_kwargs")
    if isinstance(kwargs, dict) and kwargs.get("chat_template") is not None:
        return kwargs["chat_template"]
    return body.get("chat_template")
