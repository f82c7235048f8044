"""The built-in reward types (`--rm-type`, and `rm_type` of an `--eval-config` dataset): one rule each.

Owns the registry (`RULES`; `rm_type_names()` is what `--rm-type` accepts). slime's names compute what slime's
`rm_hub` computes (THUDM/slime 624b824a; miles' names as radixark/miles 31f1ca96), each rule in its own module:
`math`, `deepscaler`, `gemma_math` (`math_rules`), `dapo` (`minerva`), `gpqa` (`gpqa`), `f1`, `ifbench`,
`random`, `deterministic_random` (here), `boxed_<t>` (`<t>` on the last box's content, slime's box rule).
Ours: `math_lenient` / `math_last_number` (rayless' earlier lenient grading, `math_grading`), `math_verify`
(Hugging Face's Math-Verify), `exact_match`, `first_digit`, `char_match`; `remote_rm` is `remote_rm.py`.
The table of every type, and the few documented places where slime is plainly wrong and we are not, is
docs/rewards.md.

Invariant: a rule is a pure function of (response text, sample) except `random` and `remote_rm`; every rule
returns a float or a dict of floats, or raises `RewardError` saying what is wrong with the sample.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import random
import re
import string
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from coordinator.rewards.gpqa import gpqa_score
from coordinator.rewards.math_grading import answers_equal, extract_boxed, extract_last_number, label_answer
from coordinator.rewards.math_rules import (
    MathLabelError,
    boxed_content,
    deepscaler_reward,
    gemma_math_reward,
    math_reward,
)
from coordinator.rewards.math_verify_rule import MathVerifyMissing, math_verify_library, math_verify_reward
from coordinator.rewards.minerva import dapo_score
from replay.sample import Sample
from workers.boundary.json_input import JsonObject, JsonValue
from workers.errors import RaylessError

FIRST_DIGIT_WINDOW = 4
BOXED_PREFIX = "boxed_"
REMOTE_RM = "remote_rm"


class RewardError(RaylessError, ValueError):
    """A reward that cannot be computed (a label of the wrong form, a missing dependency, an unknown type) or
    a reward function that broke its contract."""


RuleResult = float | dict[str, float]
RuleFn = Callable[[str, Sample], RuleResult]


@dataclass(frozen=True)
class Rule:
    """One reward type. `needs_label`: the sample must carry a label (`--label-key`); `returns_dict`: the
    reward is a dict, so a `--reward-key` must choose the entry advantages use."""

    name: str
    score: RuleFn
    needs_label: bool = True
    returns_dict: bool = False
    boxed_variant: bool = True


def _label(sample: Sample) -> str:
    return "" if sample.label is None else str(sample.label)


# ------------------------------------------------------------------------------------------ our own tasks


def exact_match(response: str, sample: Sample) -> float:
    """1.0 when the response equals the label after stripping surrounding whitespace."""
    return 1.0 if response.strip() == _label(sample).strip() else 0.0


def first_digit(response: str, sample: Sample) -> float:
    """The default task: the fraction of the first 4 response characters equal to the label character.

    Positions the response does not reach (it stopped early) count as misses: `matches / 4`, matches in 0..4.
    """
    label = _label(sample)
    if len(label) != 1:
        raise RewardError(f"rm-type first_digit needs a one-character label, got {label!r}")
    return sum(1 for char in response[:FIRST_DIGIT_WINDOW] if char == label) / FIRST_DIGIT_WINDOW


def char_match(response: str, sample: Sample) -> float:
    """The fraction of label positions whose character the response repeats at the same position."""
    label = _label(sample)
    if not label:
        raise RewardError("rm-type char_match needs a non-empty label")
    return sum(1 for i, char in enumerate(label) if response[i : i + 1] == char) / len(label)


# ------------------------------------------------------------------------------------------------- math


def _rule_error(rm_type: str, call: Callable[[], float]) -> float:
    """Run a slime rule, turning its complaint about the sample's label into a RewardError."""
    try:
        return call()
    except (MathLabelError, ValueError, OverflowError, IndexError, TypeError) as error:
        raise RewardError(f"rm-type {rm_type}: {error}") from None


def math_answer(response: str, sample: Sample) -> float:
    """slime's `math`: the last `\\boxed{}` answer only (no box: 0); see `math_rules`."""
    return math_reward(response, sample.label)


def deepscaler(response: str, sample: Sample) -> float:
    """slime's `deepscaler`: the box after the last `</think>` (or `###Response`); neither: 0."""
    return _rule_error("deepscaler", lambda: deepscaler_reward(response, sample.label))


def gemma_math(response: str, sample: Sample) -> float:
    """miles' `gemma_math`: the box after the last `<channel|>`."""
    return _rule_error("gemma_math", lambda: gemma_math_reward(response, sample.label))


def _lenient_grade(answer: str | None, label: str) -> float:
    if not label or answer is None:
        return 0.0
    return 1.0 if answers_equal(answer, label_answer(label)) else 0.0


def math_lenient(response: str, sample: Sample) -> float:
    """ours (rayless' earlier `math`): the last box (also `\\fbox{}`, `\\boxed 5`, an earlier complete box when
    the last is cut off), graded leniently (`math_grading`: arithmetic, unreduced fractions accepted)."""
    return _lenient_grade(extract_boxed(response), _label(sample))


def math_last_number(response: str, sample: Sample) -> float:
    """ours: as `math_lenient`, or without a box the last number of the response."""
    answer = extract_boxed(response)
    return _lenient_grade(answer if answer is not None else extract_last_number(response), _label(sample))


def dapo(response: str, sample: Sample) -> dict[str, float]:
    """slime's `dapo` (Minerva check, `minerva`): `{"score": 1.0, "acc": 1.0}` when right, `{"score": -1.0,
    "acc": 0.0}` when wrong. slime also returns the prediction text; rewards here are numbers, so it is left out."""
    try:
        return dapo_score(response, sample.label)
    except (ValueError, OverflowError):
        raise RewardError(
            f"rm-type dapo needs an integer label (DAPO answers are integers), got {sample.label!r}"
        ) from None


# --------------------------------------------------------------------------------------------------- f1

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = frozenset(string.punctuation)


def normalize_f1_text(text: str) -> str:
    """SQuAD's answer normalisation: lower case, punctuation and articles removed, spaces collapsed."""
    text = "".join(char for char in text.lower() if char not in _PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def f1(response: str, sample: Sample) -> float:
    """Token F1 between the response and the label (SQuAD's), in [0, 1]; slime's `f1` (its `f1.py`). The
    label must be text (slime's fails on any other)."""
    if not isinstance(sample.label, str):
        raise RewardError(f"rm-type f1 needs a text label, got {type(sample.label).__name__} {sample.label!r}")
    prediction, truth = normalize_f1_text(response), normalize_f1_text(sample.label)
    special = {"yes", "no", "noanswer"}
    if (prediction in special or truth in special) and prediction != truth:
        return 0.0
    prediction_tokens, truth_tokens = prediction.split(), truth.split()
    common = Counter(prediction_tokens) & Counter(truth_tokens)
    same = sum(common.values())
    if same == 0:
        return 0.0
    precision, recall = same / len(prediction_tokens), same / len(truth_tokens)
    return 2 * precision * recall / (precision + recall)


# ------------------------------------------------------------------------------------------------- gpqa


def gpqa(response: str, sample: Sample) -> float:
    """slime's multiple-choice check (`coordinator.rewards.gpqa`, one documented deviation)."""
    return _rule_error("gpqa", lambda: gpqa_score(response, sample.label, sample.metadata))


def math_verify(response: str, sample: Sample) -> float:
    """Hugging Face's Math-Verify on the response and the label (`coordinator.rewards.math_verify_rule`)."""
    try:
        return math_verify_reward(response, sample.label)
    except MathVerifyMissing as error:
        raise RewardError(str(error)) from None


# ---------------------------------------------------------------------------------------------- ifbench


@functools.cache
def ifbench_library() -> Any:
    """IFBench's `evaluation_lib` (github.com/allenai/IFBench, on PYTHONPATH); a clear error without it."""
    try:
        return importlib.import_module("evaluation_lib")
    except ImportError as error:
        raise RewardError(
            "rm-type ifbench needs IFBench's evaluation_lib: `git clone https://github.com/allenai/IFBench`, "
            f"`pip install -r IFBench/requirements.txt` and put the clone on PYTHONPATH ({error})"
        ) from None


def _ifbench_kwargs(raw: JsonValue, count: int) -> list[JsonObject]:
    """slime's reading of `metadata.kwargs`: a list (one dict per instruction, padded with the last) or
    one dict for all; None values dropped."""
    if isinstance(raw, list):
        entries = [dict(entry) if isinstance(entry, dict) else {} for entry in raw]
    elif isinstance(raw, dict):
        entries = [dict(raw) for _ in range(count)]
    else:
        entries = [{} for _ in range(count)]
    while len(entries) < count:
        entries.append(dict(entries[-1]) if entries else {})
    return [{k: v for k, v in entry.items() if v is not None} for entry in entries[:count]]


def ifbench(response: str, sample: Sample) -> float:
    """1.0 when the response follows every instruction of the sample's metadata (IFBench's strict check)."""
    metadata = sample.metadata or {}
    ids = [str(entry).strip() for entry in metadata.get("instruction_id_list") or []
           if entry is not None and str(entry).strip()]  # slime skips None entries (not the text "None")
    if not ids:
        return 0.0
    library = ifbench_library()
    prompt = "" if metadata.get("prompt_text") is None else str(metadata["prompt_text"])
    example = library.InputExample(key=int(metadata.get("record_id") or 0), instruction_id_list=ids,
                                   prompt=prompt, kwargs=_ifbench_kwargs(metadata.get("kwargs"), len(ids)))
    output = library.test_instruction_following_strict(example, {prompt: response})
    return 1.0 if output.follow_all_instructions else 0.0


# ------------------------------------------------------------------------------------------------ random

_RANDOM = random.Random()


def random_reward(response: str, sample: Sample) -> float:
    """0 or 1, uniformly at random (slime's `random`)."""
    return float(_RANDOM.randint(0, 1))


def deterministic_random(response: str, sample: Sample) -> float:
    """miles' `deterministic_random`: sha256(str(tokens) + response), first byte mod 2."""
    digest = hashlib.sha256((str(sample.tokens) + response).encode("utf-8")).digest()
    return float(digest[0] % 2)


def _remote_placeholder(response: str, sample: Sample) -> RuleResult:
    raise RewardError("rm-type remote_rm is scored by coordinator.rollout.remote_rm, not as a rule")


# ---------------------------------------------------------------------------------------------- registry

RULES: dict[str, Rule] = {
    rule.name: rule
    for rule in (
        Rule("math", math_answer),
        Rule("math_lenient", math_lenient),
        Rule("math_last_number", math_last_number),
        Rule("math_verify", math_verify),
        Rule("deepscaler", deepscaler),
        Rule("gemma_math", gemma_math),
        Rule("dapo", dapo, returns_dict=True),
        Rule("f1", f1),
        Rule("gpqa", gpqa, needs_label=False),
        Rule("ifbench", ifbench, needs_label=False, boxed_variant=False),
        Rule("random", random_reward, needs_label=False, boxed_variant=False),
        Rule("deterministic_random", deterministic_random, needs_label=False, boxed_variant=False),
        Rule("exact_match", exact_match),
        Rule("first_digit", first_digit),
        Rule("char_match", char_match),
        Rule(REMOTE_RM, _remote_placeholder, needs_label=False, boxed_variant=False),
    )
}


def require_libraries(rm_type: str) -> None:
    """Raise RewardError (saying what to install) when the rule of `rm_type` needs a package that is missing:
    IFBench's `evaluation_lib` for `ifbench`, Math-Verify for `math_verify`. Checked at start-up."""
    rule, _ = base_rule(rm_type)
    if rule.name == "ifbench":
        ifbench_library()
    elif rule.name == "math_verify":
        try:
            math_verify_library()
        except MathVerifyMissing as error:
            raise RewardError(str(error)) from None


def rm_type_names() -> list[str]:
    """Every name `--rm-type` accepts: the rules, and `boxed_<name>` for those graded on answer text."""
    names = sorted(RULES)
    return names + sorted(BOXED_PREFIX + name for name, rule in RULES.items() if rule.boxed_variant)


@functools.lru_cache(maxsize=128)  # asked for every scored sample; RULES is fixed at import, unknown names raise
def base_rule(rm_type: str) -> tuple[Rule, bool]:
    """(the rule, whether the response is first reduced to its last `\\boxed{}`) for a reward type name."""
    boxed = rm_type.startswith(BOXED_PREFIX) and rm_type.removeprefix(BOXED_PREFIX) in RULES
    name = rm_type.removeprefix(BOXED_PREFIX) if boxed else rm_type
    rule = RULES.get(name)
    if rule is None or (boxed and not rule.boxed_variant):
        raise RewardError(
            f"rm-type {rm_type!r} is not a built-in reward; known: {', '.join(rm_type_names())}"
        )
    return rule, boxed


def apply_rule(rm_type: str, sample: Sample) -> RuleResult:
    """The reward of `sample` under the built-in reward type `rm_type` (not `remote_rm`)."""
    rule, boxed = base_rule(rm_type)
    response = sample.response or ""
    if boxed:
        response = boxed_content(response)
    return rule.score(response, sample)
