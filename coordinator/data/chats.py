"""What a chat (a list of messages) in prompt, SFT or eval data must be for the run's chat template to take it.

Owns `chat_problem` (the first message a template could not render as meant: a role that is no chat role, a
content that is neither text, nor a list of parts, nor the null content of an assistant's tool call) and
`TemplateForms` / `template_forms` (which of the two optional forms a tokenizer's chat template renders: a list
of text parts as the text itself rather than the list printed, and an assistant's tool call with null content
without failing or writing "None"). Invariant: both read only; `chat_problem` is linear in the chat and its
reason names the message by position, for the caller to prefix with `file:line`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from workers.boundary.json_input import JsonObject, JsonValue

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

#: the roles chat templates render: the OpenAI API's, and Llama 3's tool-output role
ROLES = ("system", "developer", "user", "assistant", "tool", "function", "ipython")
_MARK = "rayless-probe-7d3"


def _kind(value: JsonValue) -> str:
    return "null" if value is None else type(value).__name__


@dataclass(frozen=True)
class TemplateForms:
    """Which optional forms of a message the run's chat template renders (None: not known here)."""

    parts: bool | None = None  # content as a list of text parts
    null_content: bool | None = None  # an assistant's tool call with null content


UNKNOWN = TemplateForms()


def _parts_problem(parts: list[JsonValue], *, parts_taken: bool | None) -> str | None:
    if parts_taken is False:
        return ("content is a list of parts, which the chat template does not render (it would print the list); "
                "give the text as a string")
    for index, part in enumerate(parts):
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            return f"content part {index} is {_kind(part)}, not an object with a string 'type'"
        if part["type"] == "text" and not isinstance(part.get("text"), str):
            return f"content part {index} is a text part whose 'text' is {_kind(part.get('text'))}, not a string"
    return None


def chat_problem(messages: list[JsonValue], *, forms: TemplateForms = UNKNOWN, loose: bool = False) -> str | None:
    """Why `messages` cannot be rendered as a chat, or None. `forms`: what the run's chat template takes (not
    known: the parts' shape alone is checked). `loose`: a custom generate function reads the chats itself —
    only objects with a string role and a content are asked for."""
    for position, message in enumerate(messages):
        if not isinstance(message, dict):
            return f"message {position} is {_kind(message)}, not an object with 'role' and 'content'"
        role = message.get("role")
        if not isinstance(role, str) or not (loose or role in ROLES):
            return f"message {position} has role {role!r}; a chat role is one of {', '.join(ROLES)}"
        if "content" not in message:
            return f"message {position} ({role}) has no 'content'"
        if loose:
            continue
        content = message["content"]
        if isinstance(content, str):
            continue
        if content is None:
            calls = message.get("tool_calls")
            if role != "assistant" or not isinstance(calls, list) or not calls:
                return (f"message {position} ({role}) has null content (only an assistant's message carrying "
                        "'tool_calls' may)")
            if forms.null_content is False:
                return (f"message {position} ({role}) has null content, which the chat template does not render: "
                        'give "" instead')
            continue
        if isinstance(content, list):
            reason = _parts_problem(content, parts_taken=forms.parts)
            if reason is not None:
                return f"message {position} ({role}): {reason}"
            continue
        return f"message {position} ({role}) has content of type {_kind(content)}; expected a string or a list of parts"
    return None


def _renders(tokenizer: PreTrainedTokenizerBase, messages: list[JsonObject]) -> str | None:
    try:
        return str(tokenizer.apply_chat_template(messages, tokenize=False))
    except Exception:  # a template that raises on the form does not take it
        return None


def template_forms(tokenizer: PreTrainedTokenizerBase) -> TemplateForms:
    """What the tokenizer's chat template renders, by rendering a probe of each form (UNKNOWN: no template)."""
    if not getattr(tokenizer, "chat_template", None):
        return UNKNOWN
    plain = _renders(tokenizer, [{"role": "user", "content": _MARK}])
    parts = _renders(tokenizer, [{"role": "user", "content": [{"type": "text", "text": _MARK}]}])
    call = {"type": "function", "function": {"name": "f", "arguments": {}}}
    null = _renders(tokenizer, [{"role": "user", "content": _MARK},
                                {"role": "assistant", "content": None, "tool_calls": [call]}])
    return TemplateForms(parts=plain is not None and parts == plain, null_content=null is not None and "None" not in null)
