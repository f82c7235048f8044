"""Rewards: the built-in `--rm-type` scorers and the router that sets `sample.reward` for a group.

Owns how a response becomes a reward. Invariants kept by `RewardModel.score_group`:
- every non-aborted sample of the group gets a finite reward: a float, or a dict of floats that contains
  `--reward-key` when one is set (a dict reward without `--reward-key` is refused at once, not later);
- aborted samples are not scored (their response is cut off at an arbitrary point); their reward is 0.0;
- a custom rm that returns the wrong type, a non-finite number or (with `--group-rm`) the wrong number of
  rewards fails with an error naming the flag, the function and the sample.

Custom rms (`--custom-rm-path`, takes precedence over `--rm-type`):
- per sample: `fn(sample) -> float | dict[str, float]`, sync or async;
- whole group (`--group-rm`): `fn(samples) -> list[float | dict[str, float]]`, one per sample, in order.
Async functions are awaited directly; the per-sample ones of a group run concurrently in a task group (a
remote reward service is not serialised). Sync functions run inline on the event loop: the built-ins are
microseconds; a slow sync rm (a big model, a sandbox) should be written `async` and offload its own work
(e.g. `await anyio.to_thread.run_sync(...)`).

Built-ins take `(response, label)`; all of them need a label (`--label-key`).
"""

from __future__ import annotations

import inspect
import math
import numbers
import re
from collections.abc import Callable, Sequence
from fractions import Fraction
from typing import Any

import anyio

from coordinator.rollout.loading import load_object
from replay.sample import Reward, Sample, SampleStatus
from workers.errors import RaylessError

FIRST_DIGIT_WINDOW = 4
MATH_RELATIVE_TOLERANCE = 1e-6
MAX_NUMBER_CHARS = 64
MAX_EXPONENT = 308


class RewardError(RaylessError, ValueError):
    """A reward that cannot be computed or a reward function that broke its contract."""


# ---------------------------------------------------------------------------------------------- built-ins


def exact_match_reward(response: str, label: str) -> float:
    """1.0 when the response equals the label after stripping surrounding whitespace."""
    return 1.0 if response.strip() == label.strip() else 0.0


def first_digit_reward(response: str, label: str) -> float:
    """The default task: the fraction of the first 4 response characters equal to the label character.

    Positions the response does not reach (it stopped early) count as misses, so the reward is always
    `matches / 4` with `matches` in 0..4.
    """
    if len(label) != 1:
        raise RewardError(f"rm-type first_digit needs a one-character label, got {label!r}")
    window = response[:FIRST_DIGIT_WINDOW]
    return sum(1 for char in window if char == label) / FIRST_DIGIT_WINDOW


def char_match_reward(response: str, label: str) -> float:
    """The fraction of label positions whose character the response repeats at the same position."""
    if not label:
        raise RewardError("rm-type char_match needs a non-empty label")
    return sum(1 for position, char in enumerate(label) if response[position : position + 1] == char) / len(
        label
    )


# ------------------------------------------------------------------------------------------- math checker

_BOXED = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])\s*")
_FRAC = r"\\[dt]?frac\s*(?:\{[^{}]*\}|\d)\s*(?:\{[^{}]*\}|\d)"
_NUMBER = r"\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?(?:[eE][-+]?\d+)?|\.\d+"
# The last "answer-like" thing in a response: a fraction command, a/b, or a number (with sign and percent).
_LAST_ANSWER = re.compile(rf"-?(?:{_FRAC}|(?:{_NUMBER})(?:\s*/\s*(?:{_NUMBER}))?)\s*(?:\\?%)?")
_FRAC_PARTS = re.compile(r"^\\[dt]?frac\s*(\{[^{}]*\}|\d)\s*(\{[^{}]*\}|\d)$")
_TEXT = re.compile(r"\\(?:text|textbf|mathrm|mbox)\s*\{([^{}]*)\}")


def _closing_braces(text: str) -> dict[int, int]:
    """For every `{` that is closed, the index of its `}` (one pass: nested braces are matched properly)."""
    open_positions: list[int] = []
    closing: dict[int, int] = {}
    for position, char in enumerate(text):
        if char == "{":
            open_positions.append(position)
        elif char == "}" and open_positions:
            closing[open_positions.pop()] = position
    return closing


def extract_boxed(text: str) -> str | None:
    """The content of the last complete `\\boxed{...}` (or `\\fbox{...}`, or `\\boxed 5`) in `text`.

    Linear in the text (brace pairs are found in one pass), so a response of thousands of `\\boxed{` costs
    no more than its length.
    """
    matches = list(_BOXED.finditer(text))
    if not matches:
        return None
    closing = _closing_braces(text)
    for match in reversed(matches):
        start = match.end()
        if start < len(text) and text[start] == "{":
            if start in closing:
                return text[start + 1 : closing[start]]
        elif text[start - 1].isspace():  # `\\boxed 5`: up to the next space, `$` or brace
            bare = re.match(r"[^\s${}]+", text[start:])
            if bare is not None:
                return bare.group(0)
    return None


def extract_math_answer(response: str) -> str | None:
    """The final `\\boxed{}` content, else the last number-like span of the response, else None."""
    boxed = extract_boxed(response)
    if boxed is not None:
        return boxed
    last = None
    for last in _LAST_ANSWER.finditer(response):  # noqa: B007 - the loop keeps the last match
        pass
    return last.group(0).strip() if last is not None else None


def _normalize_math_text(text: str) -> str:
    text = text.strip()
    boxed = extract_boxed(text)
    if boxed is not None:
        text = boxed
    for token in ("\\left", "\\right", "\\!", "\\,", "\\;", "\\:", "\\displaystyle", "$"):
        text = text.replace(token, "")
    text = _TEXT.sub(r"\1", text)
    text = re.sub(r"\^\s*\{?\s*\\circ\s*\}?|°", "", text)
    text = text.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    text = re.sub(r"\s+", "", text)
    return text.rstrip(".")


def _parse_plain_number(text: str) -> Fraction | None:
    if re.fullmatch(r"[-+]?\d{1,3}(?:,\d{3})+(?:\.\d+)?", text):
        text = text.replace(",", "")
    # Bounded: a model can emit a 100k-digit "number" or `1e999999`; exact arithmetic on those would be
    # slow (or refused by int()), so anything beyond float range is not a number and compares as text.
    if len(text) > MAX_NUMBER_CHARS:
        return None
    match = re.fullmatch(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE]([-+]?\d+))?", text)
    if match is None or (match.group(1) is not None and abs(int(match.group(1))) > MAX_EXPONENT):
        return None
    return Fraction(text)


def parse_math_number(text: str) -> tuple[Fraction, bool] | None:
    """`(value, is_percent)` for numeric answers (`1,234.5`, `-3/4`, `\\frac{1}{2}`, `50\\%`, `x = 7`)."""
    text = _normalize_math_text(text)
    if "=" in text:  # `x=7`: the answer is the right-hand side
        text = text.rsplit("=", 1)[1]
    is_percent = text.endswith("%")
    text = text.removesuffix("\\%").removesuffix("%")
    sign = Fraction(1)
    if text.startswith("-"):
        sign, text = Fraction(-1), text[1:]
    elif text.startswith("+"):
        text = text[1:]
    if not text:
        return None
    frac = _FRAC_PARTS.match(text)
    if frac is not None:
        numerator = _parse_plain_number(frac.group(1).strip("{}"))
        denominator = _parse_plain_number(frac.group(2).strip("{}"))
        if numerator is None or denominator is None or denominator == 0:
            return None
        return sign * numerator / denominator, is_percent
    if text.count("/") == 1:
        left, right = text.split("/")
        numerator, denominator = _parse_plain_number(left), _parse_plain_number(right)
        if numerator is None or denominator is None or denominator == 0:
            return None
        return sign * numerator / denominator, is_percent
    value = _parse_plain_number(text)
    return (sign * value, is_percent) if value is not None else None


def _close(a: Fraction, b: Fraction) -> bool:
    return a == b or abs(a - b) <= MATH_RELATIVE_TOLERANCE * max(abs(a), abs(b))


def math_answers_equal(answer: str, label: str) -> bool:
    """Numeric comparison when both parse as numbers (a percentage also matches its value / 100), else
    comparison of the normalised text (`\\text{}` unwrapped, spaces and `$` dropped, `\\dfrac` → `\\frac`)."""
    parsed_answer, parsed_label = parse_math_number(answer), parse_math_number(label)
    if parsed_answer is not None and parsed_label is not None:
        answers = {parsed_answer[0]} | ({parsed_answer[0] / 100} if parsed_answer[1] else set())
        labels = {parsed_label[0]} | ({parsed_label[0] / 100} if parsed_label[1] else set())
        return any(_close(a, b) for a in answers for b in labels)
    normalized = _normalize_math_text(answer)
    return bool(normalized) and normalized == _normalize_math_text(label)


def math_reward(response: str, label: str) -> float:
    """1.0 when the response's final `\\boxed{}` (or else its last number) equals the label, else 0.0."""
    answer = extract_math_answer(response)
    if answer is None:
        return 0.0
    return 1.0 if math_answers_equal(answer, label) else 0.0


BuiltinReward = Callable[[str, str], float]
BUILTIN_RM_TYPES: dict[str, BuiltinReward] = {
    "exact_match": exact_match_reward,
    "math": math_reward,
    "first_digit": first_digit_reward,
    "char_match": char_match_reward,
}


# ------------------------------------------------------------------------------------------------- router


def _where(sample: Sample) -> str:
    return f"sample {sample.group_index}/{sample.sample_index}"


def _is_async_callable(fn: Any) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))  # noqa: B004


class RewardModel:
    """Scores groups of samples with a built-in rm type or a custom function (custom wins when both are set)."""

    def __init__(
        self,
        *,
        rm_type: str | None = None,
        custom_rm_path: str | None = None,
        group_rm: bool = False,
        reward_key: str | None = None,
        custom_rm: Callable[..., Any] | None = None,
    ) -> None:
        """`custom_rm` passes the function itself (tests, programmatic use) instead of `custom_rm_path`."""
        self.rm_type = rm_type
        self.group_rm = group_rm
        self.reward_key = reward_key
        self._builtin: BuiltinReward | None = None
        self._custom: Callable[..., Any] | None = custom_rm
        self._custom_name = getattr(custom_rm, "__qualname__", repr(custom_rm)) if custom_rm else ""
        if self._custom is None and custom_rm_path:
            self._custom = load_object(custom_rm_path, what="--custom-rm-path")
            self._custom_name = custom_rm_path
        if self._custom is not None:
            if not callable(self._custom):
                raise RewardError(f"--custom-rm-path {self._custom_name!r} is not callable")
            self._custom_is_async = _is_async_callable(self._custom)
        elif rm_type:
            if rm_type not in BUILTIN_RM_TYPES:
                raise RewardError(
                    f"--rm-type {rm_type!r} is not a built-in reward; known: {', '.join(sorted(BUILTIN_RM_TYPES))} "
                    "(or pass --custom-rm-path)"
                )
            self._builtin = BUILTIN_RM_TYPES[rm_type]
        else:
            raise RewardError("no reward function: set --rm-type or --custom-rm-path")

    def _check(self, value: Any, sample: Sample) -> Reward:
        source = (
            f"--custom-rm-path {self._custom_name!r}"
            if self._custom is not None
            else f"--rm-type {self.rm_type}"
        )
        if isinstance(value, bool):
            value = float(value)
        if isinstance(value, numbers.Real):
            reward = float(value)
            if not math.isfinite(reward):
                raise RewardError(f"{source} returned {reward} for {_where(sample)}; rewards must be finite")
            return reward
        if isinstance(value, dict):
            checked: dict[str, float] = {}
            for key, item in value.items():
                if not isinstance(key, str) or isinstance(item, bool) or not isinstance(item, numbers.Real):
                    raise RewardError(
                        f"{source} returned a dict with entry {key!r}: {item!r} for {_where(sample)}; "
                        "a dict reward must map str to float"
                    )
                if not math.isfinite(float(item)):
                    raise RewardError(
                        f"{source} returned {key!r}: {item} for {_where(sample)}; rewards must be finite"
                    )
                checked[key] = float(item)
            if self.reward_key is None:
                raise RewardError(
                    f"{source} returned a dict reward ({sorted(checked)}) for {_where(sample)}; "
                    "pass --reward-key to choose the entry used for advantages"
                )
            if self.reward_key not in checked:
                raise RewardError(
                    f"--reward-key {self.reward_key!r} is not in the reward {source} returned for "
                    f"{_where(sample)} (keys: {sorted(checked)})"
                )
            return checked
        raise RewardError(
            f"{source} returned {type(value).__name__} ({value!r:.80}) for {_where(sample)}; "
            "expected a float or a dict[str, float]"
        )

    def _score_builtin(self, sample: Sample) -> None:
        assert self._builtin is not None
        if sample.label is None:
            raise RewardError(
                f"--rm-type {self.rm_type} needs a label but {_where(sample)} has none (set --label-key)"
            )
        sample.reward = self._check(self._builtin(sample.response, sample.label), sample)

    async def _score_custom_one(self, sample: Sample) -> None:
        assert self._custom is not None
        value = self._custom(sample)
        if inspect.isawaitable(value):
            value = await value
        sample.reward = self._check(value, sample)

    async def _score_custom_group(self, samples: Sequence[Sample]) -> None:
        assert self._custom is not None
        values = self._custom(list(samples))
        if inspect.isawaitable(values):
            values = await values
        if not isinstance(values, (list, tuple)):
            raise RewardError(
                f"--custom-rm-path {self._custom_name!r} with --group-rm returned {type(values).__name__}; "
                f"expected a list of {len(samples)} rewards"
            )
        if len(values) != len(samples):
            raise RewardError(
                f"--custom-rm-path {self._custom_name!r} with --group-rm returned {len(values)} rewards "
                f"for a group of {len(samples)} samples"
            )
        checked = [self._check(value, sample) for value, sample in zip(values, samples, strict=True)]
        for sample, reward in zip(samples, checked, strict=True):
            sample.reward = reward

    async def score_group(self, samples: list[Sample]) -> None:
        """Set `reward` on every sample of one prompt group (aborted samples get 0.0 unscored)."""
        scored = [sample for sample in samples if sample.status is not SampleStatus.ABORTED]
        for sample in samples:
            if sample.status is SampleStatus.ABORTED:
                sample.reward = 0.0
        if not scored:
            return
        if self._builtin is not None:
            for sample in scored:
                self._score_builtin(sample)
        elif self.group_rm:
            await self._score_custom_group(scored)
        elif self._custom_is_async:
            async with anyio.create_task_group() as task_group:
                for sample in scored:
                    task_group.start_soon(self._score_custom_one, sample)
        else:
            for sample in scored:
                await self._score_custom_one(sample)
