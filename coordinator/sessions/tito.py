"""Token in, token out: how the session server builds each turn's prompt ids, as miles' TITO tokenizers do.

Owns the `--tito-model` families (all of miles': the two DeepSeek ones render with DeepSeek's own message
encoders, `coordinator.sessions.deepseek_encoding`, where the others use the model's chat template) and the
message matchers (`--session-message-matcher`). The first turn of a session is the chat template over its messages; each
later turn is the session's stored ids (the previous prompt and exactly the tokens the engine generated)
followed by the ids of only the newly appended messages, rendered as the suffix the template adds after a
placeholder system + assistant pair (miles' `_tokenize_rendered_suffix`). So what trains is what was sampled:
no turn is re-tokenised.

Invariants: appended messages must have an allowed role (user, tool, system, developer) and the stored
messages must match the request's first messages (the matcher), else a `SessionRequestError` (400) naming the
first mismatch; each family's merge fixes only its boundary token: `qwen3`/`qwen35`/`qwennext`/`nemotron3` insert the
newline the template writes after `<|im_end|>` that the model stops before (`minimax_m25`/`_m27`: after `[e~[`),
`glm47` drops a final `<|user|>`/`<|observation|>` (a stop token that also opens the next message), and
`default`/`kimi25`/`kimi26`/`inkling`/`deepseekv32`/`deepseekv4` append as they are; a family's pinned
chat-template kwargs are applied (the DeepSeek families: `drop_thinking=False`, which keeps their renders
append-only).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

from coordinator.sessions.deepseek_encoding import (
    ASSISTANT,
    MODE_KWARGS,
    USER,
    DeepSeekEncodingError,
    encode_v4,
    encode_v32,
    thinking_mode,
    with_tools,
)
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
    #: chat-template kwargs the family pins so that history renders append-only (miles' FixedTemplate
    #: extra_kwargs); a conflicting value from --apply-chat-template-kwargs is an error
    pinned_kwargs: ClassVar[dict[str, Any]] = {}
    #: roles that may be appended after an assistant turn (a family whose template drops some narrows it)
    append_roles: ClassVar[frozenset[str]] = ALLOWED_APPEND_ROLES
    #: a vision-language policy: how its messages' image_url parts reach the template (the session server sets
    #: `coordinator.sessions.images.template_messages`); None: text parts joined, other parts refused
    message_parts: Callable[[list[JsonObject]], list[JsonObject]] | None = None

    def __init__(self, tokenizer: PreTrainedTokenizerBase, chat_template_kwargs: JsonObject | None = None) -> None:
        self.tokenizer = tokenizer
        kwargs = dict(chat_template_kwargs or {})
        for key, value in self.pinned_kwargs.items():
            if key in kwargs and kwargs[key] != value:
                raise ValueError(f"--tito-model {self.family}: chat template kwarg {key}={kwargs[key]!r} conflicts "
                                 f"with the family's {key}={value!r} (which keeps history append-only)")
            kwargs[key] = value
        self.chat_template_kwargs = kwargs

    def _token_id(self, token: str) -> int:
        """The id of one of the family's special tokens; ValueError when the tokenizer lacks it."""
        ids = self.tokenizer.encode(token, add_special_tokens=False)
        if len(ids) != 1:
            raise ValueError(f"--tito-model {self.family}: the tokenizer has no single token {token!r} (got {ids}); "
                             "is this the family's model?")
        return int(ids[0])

    def render(self, messages: list[JsonObject], *, add_generation_prompt: bool,
               tools: list[JsonValue] | None) -> str:
        try:
            if self.message_parts is not None:  # a VLM: the template writes each image's placeholder
                messages = self.message_parts(messages)
            else:  # As the engine renders chat (SGLang's 'string' content format): text parts joined, None as "".
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
        bad = [m.get("role") for m in appended if m.get("role") not in self.append_roles]
        if bad:
            raise SessionRequestError(f"messages appended after the last assistant turn may have the roles "
                                      f"{sorted(self.append_roles)} (--tito-model {self.family}), got {bad[0]!r}")
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


class NewlineAfterStopTito(TitoTokenizer):
    """Families whose template writes `STOP\\n` after every message while the model stops at `STOP`: the newline
    is inserted after stored ids that end at `STOP`."""

    stop_token = "<|im_end|>"

    def __init__(self, tokenizer: PreTrainedTokenizerBase, chat_template_kwargs: JsonObject | None = None) -> None:
        super().__init__(tokenizer, chat_template_kwargs)
        newline = tokenizer.encode("\n", add_special_tokens=False)
        if len(newline) != 1:
            raise ValueError(f"--tito-model {self.family}: the tokenizer encodes a newline as {newline}, not one token")
        self.newline_id = newline[0]
        self.stop_id = self._token_id(self.stop_token)

    def merge(self, stored_ids: list[int], appended_ids: list[int]) -> list[int]:
        prefix = list(stored_ids)
        if prefix and prefix[-1] == self.stop_id:
            prefix.append(self.newline_id)
        return prefix + list(appended_ids)


class Qwen3TitoTokenizer(NewlineAfterStopTito):
    """Qwen3: the template writes `<|im_end|>\\n` after every message; the model stops at `<|im_end|>`."""

    family = "qwen3"


class Qwen35TitoTokenizer(Qwen3TitoTokenizer):
    """Qwen3.5: Qwen3's boundary; `clear_thinking=False`; no system message appended mid-session (miles
    registers tool / user / assistant appends only)."""

    family = "qwen35"
    pinned_kwargs = {"clear_thinking": False}
    append_roles = frozenset({"user", "tool"})


class QwenNextTitoTokenizer(Qwen3TitoTokenizer):
    """Qwen3-Thinking-2507 / Qwen3-Next-Thinking: Qwen3's boundary, `clear_thinking=False`."""

    family = "qwennext"
    pinned_kwargs = {"clear_thinking": False}


class Nemotron3TitoTokenizer(Qwen3TitoTokenizer):
    """NVIDIA Nemotron 3: Qwen3's `<|im_end|>\\n` boundary; `truncate_history_thinking=False` keeps the native
    template append-only."""

    family = "nemotron3"
    pinned_kwargs = {"truncate_history_thinking": False}


class Glm47TitoTokenizer(TitoTokenizer):
    """GLM-4.7: `<|user|>` and `<|observation|>` both stop the model and open the next message, so stored ids
    ending at one of them lose it (the appended suffix writes the right opener)."""

    family = "glm47"
    pinned_kwargs = {"clear_thinking": False}

    def __init__(self, tokenizer: Any, chat_template_kwargs: dict[str, Any] | None = None) -> None:
        super().__init__(tokenizer, chat_template_kwargs)
        self.boundary_ids = frozenset({self._token_id("<|observation|>"), self._token_id("<|user|>")})

    def merge(self, stored_ids: list[int], appended_ids: list[int]) -> list[int]:
        prefix = list(stored_ids)
        if prefix and prefix[-1] in self.boundary_ids:
            prefix = prefix[:-1]
        return prefix + list(appended_ids)


class Kimi25TitoTokenizer(TitoTokenizer):
    """Moonshot Kimi K2.5: messages end at `<|im_end|>` with no newline after it (stored ids + suffix as they
    are); `preserve_thinking=True` keeps earlier reasoning when a user turn is appended."""

    family = "kimi25"
    pinned_kwargs = {"preserve_thinking": True}


class Kimi26TitoTokenizer(Kimi25TitoTokenizer):
    """Moonshot Kimi K2.6: K2.5's boundary; its template reads `preserve_thinking` natively."""

    family = "kimi26"


class MinimaxM25TitoTokenizer(NewlineAfterStopTito):
    """MiniMax-M2.5: the template writes `[e~[\\n` after a message, the model stops at `[e~[`;
    `clear_thinking=False`; no mid-session system message (its template ignores them)."""

    family = "minimax_m25"
    stop_token = "[e~["
    pinned_kwargs = {"clear_thinking": False}
    append_roles = frozenset({"user", "tool"})


class MinimaxM27TitoTokenizer(MinimaxM25TitoTokenizer):
    """MiniMax-M2.7: M2.5's tokenizer and boundary (only the default system identity differs)."""

    family = "minimax_m27"


class InklingTitoTokenizer(TitoTokenizer):
    """Inkling: stored ids + the suffix as the template writes it (no boundary token to fix)."""

    family = "inkling"


class DeepSeekV32TitoTokenizer(TitoTokenizer):
    """DeepSeek V3.2: no chat template; prompts from DeepSeek's `encoding_dsv32` as miles vendors it, with
    `drop_thinking=False` (every assistant keeps its thinking block, so appending a user turn rewrites nothing).
    The model stops at `<｜end▁of▁sentence｜>`, which the encoder writes after every assistant turn: stored ids
    and the appended suffix join as they are. The kwargs it reads: `thinking_mode` / `enable_thinking` /
    `thinking` (thinking on unless one says otherwise), and `drop_thinking` (pinned)."""

    family = "deepseekv32"
    pinned_kwargs = {"drop_thinking": False}
    #: kwargs the encoder takes besides the mode ones and `drop_thinking`
    encoder_kwargs: ClassVar[tuple[str, ...]] = ()

    def __init__(self, tokenizer: PreTrainedTokenizerBase, chat_template_kwargs: JsonObject | None = None) -> None:
        super().__init__(tokenizer, chat_template_kwargs)
        known = {*MODE_KWARGS, *self.pinned_kwargs, *self.encoder_kwargs}
        if unknown := sorted(set(self.chat_template_kwargs) - known):
            raise ValueError(f"--tito-model {self.family}: DeepSeek's encoder takes no chat template kwarg "
                             f"{', '.join(unknown)} (it reads {', '.join(sorted(known))})")
        try:
            self.mode = thinking_mode(self.chat_template_kwargs)
        except DeepSeekEncodingError as error:
            raise ValueError(f"--tito-model {self.family}: {error}") from None
        # miles records the resolved mode as `thinking` (SGLang's DeepSeek parsers read that kwarg)
        self.chat_template_kwargs = {**self.chat_template_kwargs, "thinking": self.mode == "thinking"}
        for token in (USER, ASSISTANT):
            self._token_id(token)

    def _encode_messages(self, messages: list[JsonObject], *, add_generation_prompt: bool) -> str:
        return encode_v32(messages, mode=self.mode, add_generation_prompt=add_generation_prompt)

    def render(self, messages: list[JsonObject], *, add_generation_prompt: bool,
               tools: list[JsonValue] | None) -> str:
        try:
            messages = normalise_messages(messages)  # content parts joined, null content as "" (as SGLang)
            return self._encode_messages(with_tools(messages, tools), add_generation_prompt=add_generation_prompt)
        except ValueError as error:  # DeepSeekEncodingError too: the messages are wrong
            raise SessionRequestError(f"DeepSeek's encoder cannot render these messages: {error}") from None


class DeepSeekV4TitoTokenizer(DeepSeekV32TitoTokenizer):
    """DeepSeek V4: SGLang's `encoding_dsv4` with `drop_thinking=False`; tool results fold into a user turn (V4
    has no tool role), so only user and tool messages are appended mid-session (miles registers tool, user and
    assistant; rayless appends no assistant). The diff of a placeholder pair with and without the appended
    messages equals miles' diff of the real history: with `drop_thinking=False` a turn's render depends only on
    itself and the role after it, and the placeholder assistant carries the stored one's tool calls (their ids
    order the folded results). Reads `reasoning_effort` (`max`, `high`) too."""

    family = "deepseekv4"
    append_roles = frozenset({"user", "tool"})
    encoder_kwargs = ("reasoning_effort",)

    def _encode_messages(self, messages: list[JsonObject], *, add_generation_prompt: bool) -> str:
        effort = self.chat_template_kwargs.get("reasoning_effort")
        return encode_v4(messages, mode=self.mode, add_generation_prompt=add_generation_prompt,
                         reasoning_effort=None if effort is None else str(effort))


FAMILIES: dict[str, type[TitoTokenizer]] = {
    family.family: family for family in (
        TitoTokenizer, Qwen3TitoTokenizer, Qwen35TitoTokenizer, QwenNextTitoTokenizer, Nemotron3TitoTokenizer,
        Glm47TitoTokenizer, Kimi25TitoTokenizer, Kimi26TitoTokenizer, MinimaxM25TitoTokenizer,
        MinimaxM27TitoTokenizer, InklingTitoTokenizer, DeepSeekV32TitoTokenizer, DeepSeekV4TitoTokenizer)
}


def tito_tokenizer(family: str, tokenizer: PreTrainedTokenizerBase, chat_template_kwargs: JsonObject | None = None) -> TitoTokenizer:
    return FAMILIES[family](tokenizer, chat_template_kwargs)
