"""Token in, token out: how the session server builds each turn's prompt ids, as miles' TITO tokenizers do.

Owns the `--tito-model` families rayless implements (`default`, `qwen3`) and the message matchers
(`--session-message-matcher`). The first turn of a session is the chat template over its messages; each
later turn is the session's stored ids (the previous prompt and exactly the tokens the engine generated)
followed by the ids of only the newly appended messages, rendered as the suffix the template adds after a
placeholder system + assistant pair (miles' `_tokenize_rendered_suffix`). So what trains is what was sampled:
no turn is re-tokenised.

Invariants: appended messages must have an allowed role (user, tool, system, developer) and the stored
messages must match the request's first messages (the matcher), else a `SessionRequestError` (400) naming the
first mismatch; `qwen3` inserts the newline the template writes after `<|im_end|>` that the model stops before.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from workers.boundary.json_input import JsonObject, JsonValue, decode_json
from workers.engine.openai_protocol import normalise_messages
from workers.errors import RaylessError
from workers.hook_loading import load_object

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

ALLOWED_APPEND_ROLES = frozenset({"user", "tool", "system", "developer"})
_DUMMY_SYSTEM = {"role": "system", "content": "FOR CALCULATING TOKENS ONLY"}
_TEMPLATE_KEYS = ("role", "content", "reasoning_content", "tool_calls")

Matcher = Callable[[dict[str, Any], dict[str, Any]], bool]


class SessionRequestError(RaylessError, ValueError):
    """A chat request the session cannot continue from (answered 400 with this message)."""


def _normal(value: JsonValue) -> JsonValue:
    if value in (None, "", []):
        return None
    if isinstance(value, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in value):
        return "\n".join(str(p.get("text", "")) for p in value)
    return value


def _tool_calls(value: JsonValue) -> JsonValue:
    if not isinstance(value, list):
        return _normal(value)
    calls = []
    for call in value:
        if not isinstance(call, dict):
            calls.append(call)
            continue
        function = dict(call.get("function") or {})
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                function["arguments"] = decode_json(arguments, "tool-call arguments in the engine's reply")
            except ValueError:
                pass
        calls.append({"type": call.get("type", "function"), "function": function})
    return calls or None


def strict_matches(stored: JsonObject, new: JsonObject) -> bool:
    """miles' strict matcher: the keys a chat template reads (role, content, reasoning_content, tool_calls),
    with wire-only tool-call keys (id, index) and JSON spacing of arguments ignored."""
    for key in _TEMPLATE_KEYS:
        a, b = stored.get(key), new.get(key)
        if key == "tool_calls":
            a, b = _tool_calls(a), _tool_calls(b)
        if _normal(a) != _normal(b):
            return False
    return True


def role_content_matches(stored: JsonObject, new: JsonObject) -> bool:
    return stored.get("role") == new.get("role") and _normal(stored.get("content")) == _normal(new.get("content"))


def resolve_matcher(selector: str) -> Matcher:
    builtins: dict[str, Matcher] = {"strict": strict_matches, "role_content_only": role_content_matches}
    if selector in builtins:
        return builtins[selector]
    return load_object(selector, what="--session-message-matcher")


class TitoTokenizer:
    """The `default` family: the model's own chat template, stored ids + appended suffix."""

    family = "default"

    def __init__(self, tokenizer: PreTrainedTokenizerBase, chat_template_kwargs: JsonObject | None = None) -> None:
        self.tokenizer = tokenizer
        self.chat_template_kwargs = dict(chat_template_kwargs or {})

    def render(self, messages: list[JsonObject], *, add_generation_prompt: bool,
               tools: list[JsonValue] | None) -> str:
        try:
            # As the engine renders chat (SGLang's 'string' content format): text parts joined, None as "".
            messages = normalise_messages(messages)
        except ValueError as error:
            raise SessionRequestError(str(error)) from None
        try:
            return str(self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt, tools=tools,
                **self.chat_template_kwargs))
        except Exception as error:  # jinja2's errors, a template's raise_exception: the messages are wrong
            raise SessionRequestError(f"the chat template cannot render these messages: {error}") from None

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def first_prompt(self, messages: list[JsonObject], tools: list[JsonValue] | None) -> list[int]:
        return self.encode(self.render(messages, add_generation_prompt=True, tools=tools))

    def appended_ids(self, last_assistant: JsonObject, appended: list[JsonObject],
                     tools: list[JsonValue] | None) -> list[int]:
        """The ids of `appended` (and the generation prompt) after an assistant turn, as the template writes
        them: the suffix of rendering a placeholder pair with them over rendering the pair alone."""
        bad = [m.get("role") for m in appended if m.get("role") not in ALLOWED_APPEND_ROLES]
        if bad:
            raise SessionRequestError(f"messages appended after the last assistant turn may have the roles "
                                      f"{sorted(ALLOWED_APPEND_ROLES)}, got {bad[0]!r}")
        base = [_DUMMY_SYSTEM, {"role": "assistant", "content": "",
                                "tool_calls": last_assistant.get("tool_calls") or []}]
        without = self.render(base, add_generation_prompt=False, tools=tools)
        with_new = self.render(base + appended, add_generation_prompt=True, tools=tools)
        if not with_new.startswith(without):
            raise SessionRequestError(f"the chat template renders the appended messages "
                                      f"{[m.get('role') for m in appended]} by rewriting earlier turns")
        return self.encode(with_new[len(without):])

    def merge(self, stored_ids: list[int], appended_ids: list[int]) -> list[int]:
        return list(stored_ids) + list(appended_ids)


class Qwen3TitoTokenizer(TitoTokenizer):
    """Qwen3: the template writes `<|im_end|>\\n` after every message; the model stops at `<|im_end|>`."""

    family = "qwen3"

    def __init__(self, tokenizer: PreTrainedTokenizerBase, chat_template_kwargs: JsonObject | None = None) -> None:
        super().__init__(tokenizer, chat_template_kwargs)
        newline = tokenizer.encode("\n", add_special_tokens=False)
        if len(newline) != 1:
            raise ValueError(f"--tito-model qwen3: the tokenizer encodes a newline as {newline}, not one token")
        self.newline_id = newline[0]
        self.im_end_id = tokenizer.convert_tokens_to_ids("<|im_end|>")

    def merge(self, stored_ids: list[int], appended_ids: list[int]) -> list[int]:
        prefix = list(stored_ids)
        if prefix and prefix[-1] == self.im_end_id:
            prefix.append(self.newline_id)
        return prefix + list(appended_ids)


FAMILIES: dict[str, type[TitoTokenizer]] = {"default": TitoTokenizer, "qwen3": Qwen3TitoTokenizer}


def tito_tokenizer(family: str, tokenizer: PreTrainedTokenizerBase, chat_template_kwargs: JsonObject | None = None) -> TitoTokenizer:
    return FAMILIES[family](tokenizer, chat_template_kwargs)
