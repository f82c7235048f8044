"""slime's `--apply-chat-template-kwargs`: keyword arguments every chat-template rendering of the run gets
(`{"enable_thinking": false}` for Qwen3, say).

Owns `with_chat_template_kwargs`, a tokenizer whose `apply_chat_template` adds the run's keyword arguments
(a call's own arguments win); everything else is the wrapped tokenizer's. Invariant: without kwargs the
tokenizer itself is returned, so a run without the flag renders exactly as before.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from workers.boundary.json_input import JsonValue

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class ChatTemplateKwargs:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, kwargs: Mapping[str, object]) -> None:
        self.wrapped = tokenizer
        self.chat_template_kwargs = dict(kwargs)

    def apply_chat_template(self, conversation: JsonValue, *args: object, **kwargs: object) -> Any:
        return self.wrapped.apply_chat_template(conversation, *args, **{**self.chat_template_kwargs, **kwargs})

    def __call__(self, *args: object, **kwargs: object) -> Any:
        return self.wrapped(*args, **kwargs)

    def __len__(self) -> int:
        return len(self.wrapped)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.wrapped, name)


def with_chat_template_kwargs(tokenizer: PreTrainedTokenizerBase, kwargs: Mapping[str, object] | None) -> Any:
    if tokenizer is None or not kwargs:
        return tokenizer
    return ChatTemplateKwargs(tokenizer, kwargs)
