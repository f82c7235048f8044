"""slime's `--apply-chat-template-kwargs`: keyword arguments every chat-template rendering of the run gets
(`{"enable_thinking": false}` for Qwen3, say).

Owns `with_chat_template_kwargs`, a tokenizer whose `apply_chat_template` adds the run's keyword arguments
(a call's own arguments win); everything else is the wrapped tokenizer's. Invariant: without kwargs the
tokenizer itself is returned, so a run without the flag renders exactly as before.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


class ChatTemplateKwargs:
    def __init__(self, tokenizer: Any, kwargs: Mapping[str, Any]) -> None:
        self.wrapped = tokenizer
        self.chat_template_kwargs = dict(kwargs)

    def apply_chat_template(self, conversation: Any, *args: Any, **kwargs: Any) -> Any:
        return self.wrapped.apply_chat_template(conversation, *args, **{**self.chat_template_kwargs, **kwargs})

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.wrapped(*args, **kwargs)

    def __len__(self) -> int:
        return len(self.wrapped)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.wrapped, name)


def with_chat_template_kwargs(tokenizer: Any, kwargs: Mapping[str, Any] | None) -> Any:
    if tokenizer is None or not kwargs:
        return tokenizer
    return ChatTemplateKwargs(tokenizer, kwargs)
