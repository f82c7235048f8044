"""Which tokens of a chat are trained: slime's `--loss-mask-type` rules, applied with the tokenizer's template.

Owns `ChatLossMask`: a chat (a list of `{"role", "content"}` messages, optionally tools) → its token ids and a
loss mask of the same length, 1 exactly on the assistant turns (every one of a multi-turn chat) from the first
token after the assistant header through the turn's end marker, 0 elsewhere and on any message with
`step_loss_mask` other than 1. The rules are slime's `MultiTurnLossMaskGenerator` (slime/utils/mask_utils.py):
- `qwen`: each message rendered alone; the header length of an assistant turn (`gen_token_length`) and the
  template's per-message preamble (`system_message_length`, e.g. Qwen2.5's default system prompt) measured once
  by rendering a probe chat; a tokenizer with DeepSeek's `<｜Assistant｜>` token is `distill_qwen`;
- `qwen3`: each message rendered against a fixed neighbour turn and cut out (Qwen3's template depends on
  context), consecutive tool messages as one turn;
- `qwen3_5`: the whole chat rendered once, the mask taken by character spans of the assistant turns;
- `distill_qwen`: the first message as the prompt, the last message's content as the response.
Invariant: `len(token_ids) == len(loss_mask)`; a rule that cannot find its markers raises `LossMaskError`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from workers.boundary.json_input import JsonObject
from workers.errors import RaylessError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

Messages = list[dict[str, Any]]
_PROBE = "FOR TESTING ONLY"
_NEIGHBOUR = {"role": "user", "content": "FOR CALCULATING LOSS MASK ONLY"}
_DISTILL_ASSISTANT = "<｜Assistant｜>"


class LossMaskError(RaylessError, ValueError):
    """A chat (or a tokenizer's template) the loss-mask rule cannot split into trained and untrained tokens."""


def response_length(loss_mask: list[int]) -> int:
    """slime's response: from the first trained token to the end (0 when nothing is trained)."""
    return len(loss_mask) - loss_mask.index(1) if 1 in loss_mask else 0


def _trained(message: JsonObject) -> bool:
    return message.get("step_loss_mask", 1) == 1


class ChatLossMask:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, mask_type: str = "qwen") -> None:
        self.tokenizer = tokenizer
        self.mask_type = mask_type
        self.preamble_length = self.header_length = 0
        if mask_type == "qwen" and _DISTILL_ASSISTANT in tokenizer.get_added_vocab():
            self.mask_type = "distill_qwen"
        elif mask_type in ("qwen", "qwen3"):
            self.preamble_length, self.header_length = self._measure_template()

    def _ids(self, messages: Messages, **kwargs: object) -> list[int]:
        ids = self.tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False, **kwargs)
        return list(ids["input_ids"] if isinstance(ids, dict) else ids)

    def _text_ids(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _measure_template(self) -> tuple[int, int]:
        """(tokens the template puts before each message rendered alone, tokens of the assistant header)."""
        probe = [{"role": "user", "content": _PROBE}, {"role": "user", "content": _PROBE}]
        raw = self._text_ids(_PROBE)
        rendered = self._text_ids(self.tokenizer.apply_chat_template(probe, tokenize=False))
        found = [i for i in range(len(rendered) - len(raw) + 1) if rendered[i:i + len(raw)] == raw]
        if len(found) != 2:
            raise LossMaskError(f"--loss-mask-type {self.mask_type}: the tokenizer's chat template does not render "
                                f"a probe text once per message ({len(found)} times in two messages); try another "
                                "--loss-mask-type")
        first, second = found
        tail = len(rendered) - len(raw) - second
        header = len(self._ids(probe, add_generation_prompt=True)) - len(rendered)
        return first - ((second - first) - tail - len(raw)), header

    def _turn_mask(self, message: JsonObject, length: int) -> list[int]:
        if message["role"] != "assistant" or not _trained(message):
            return [0] * length
        return [0] * self.header_length + [1] * (length - self.header_length)

    def __call__(self, messages: Messages, tools: list[JsonObject] | None = None) -> tuple[list[int], list[int]]:
        """(token ids, loss mask) of one chat."""
        if not messages:
            raise LossMaskError("a chat with no messages")
        rule = {"qwen": self._qwen, "qwen3": self._qwen3, "qwen3_5": self._by_characters,
                "distill_qwen": self._distill}.get(self.mask_type)
        if rule is None:
            raise LossMaskError(f"--loss-mask-type {self.mask_type!r} is not a rule of slime's")
        token_ids, loss_mask = rule(messages, tools)
        if len(token_ids) != len(loss_mask):  # slime's SFT rollout stops on this too
            raise LossMaskError(f"--loss-mask-type {self.mask_type} does not fit this tokenizer's chat template "
                                f"({len(token_ids)} token ids, {len(loss_mask)} mask entries); try another")
        return token_ids, loss_mask

    def _qwen(self, messages: Messages, tools: list[JsonObject] | None) -> tuple[list[int], list[int]]:
        token_ids: list[int] = []
        loss_mask: list[int] = []
        for i, message in enumerate(messages):
            ids = self._ids([message], tools=tools) if i == 0 else self._ids([message])
            if i > 0 and message["role"] != "system":
                ids = ids[self.preamble_length:]
            token_ids += ids
            loss_mask += self._turn_mask(message, len(ids))
        return token_ids, loss_mask

    def _qwen3(self, messages: Messages, tools: list[JsonObject] | None) -> tuple[list[int], list[int]]:
        neighbour = self._ids([_NEIGHBOUR])
        token_ids: list[int] = []
        loss_mask: list[int] = []
        i = 0
        while i < len(messages):
            end = i + 1
            if messages[i]["role"] == "tool":  # Qwen's templates wrap consecutive tool results in one user turn
                while end < len(messages) and messages[end]["role"] == "tool":
                    end += 1
            turn = messages[i:end]
            if i == 0:
                ids = self._ids([*turn, _NEIGHBOUR], tools=tools)[:-len(neighbour)]
            else:
                ids = self._ids([_NEIGHBOUR, *turn])[len(neighbour):]
                if messages[i]["role"] != "system":
                    ids = ids[self.preamble_length:]
            token_ids += ids
            loss_mask += self._turn_mask(messages[i], len(ids))
            i = end
        return token_ids, loss_mask

    def _by_characters(self, messages: Messages, tools: list[JsonObject] | None) -> tuple[list[int], list[int]]:
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, tools=tools)
        encoded = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        token_ids, offsets = list(encoded["input_ids"]), encoded.get("offset_mapping")
        if offsets is None:
            raise LossMaskError("--loss-mask-type qwen3_5 needs a fast tokenizer (character offsets)")
        if token_ids != self._ids(messages, tools=tools):
            raise LossMaskError("--loss-mask-type qwen3_5: the rendered text does not tokenize to the template's "
                                "own token ids")
        header, think, end_marker = "<|im_start|>assistant\n", "<think>\n", "<|im_end|>"
        trained = [0] * (len(text) + 1)  # prefix sums of trained characters
        marks = [0] * len(text)
        cursor = 0
        for message in (m for m in messages if m["role"] == "assistant"):
            start = text.find(header, cursor)
            stop = text.find(end_marker, start + len(header)) if start >= 0 else -1
            if stop < 0:
                raise LossMaskError("--loss-mask-type qwen3_5: an assistant turn without its header or "
                                    f"{end_marker} in the rendered chat")
            content = start + len(header)
            span_end = stop + len(end_marker) + (text[stop + len(end_marker):].startswith("\n"))
            cursor = span_end
            if _trained(message):
                first = content + len(think) if text.startswith(think, content) else content
                marks[first:span_end] = [1] * (span_end - first)
        for position, value in enumerate(marks):
            trained[position + 1] = trained[position] + value
        loss_mask = [int(end > start and trained[end] > trained[start]) for start, end in offsets]
        return token_ids, loss_mask

    def _distill(self, messages: Messages, tools: list[JsonObject] | None) -> tuple[list[int], list[int]]:
        prompt = self.tokenizer.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True,
                                                    tools=tools)
        prompt_ids, response_ids = self._text_ids(prompt), self._text_ids(messages[-1]["content"])
        trained = 1 if _trained(messages[-1]) else 0
        return prompt_ids + response_ids, [0] * len(prompt_ids) + [trained] * len(response_ids)
