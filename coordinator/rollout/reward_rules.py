"""The built-in reward types (`--rm-type`, and `rm_type` of an `--eval-config` dataset): one rule each.

Owns the registry (`RULES`; `rm_type_names()` is what `--rm-type` accepts) and the rule of every name that
slime and miles scripts use, plus ours. The rules are slime's (`slime/rollout/rm_hub`), written here:

| name | reward | right when |
|---|---|---|
| `math` | 1 / 0 | the last `\\boxed{}` of the response equals the label (a boxed label: its content) |
| `math_last_number` | 1 / 0 | ours (rayless' old `math`): like `math`, but without a box the last number counts |
| `deepscaler` | 1 / 0 | as `math`, on the text after the last `</think>` (or between the first two `###Response`);
  **without either delimiter: 0** |
| `gemma_math` | 1 / 0 | (miles) as `math`, on the text after the last `<channel|>` when there is one |
| `dapo` | `{score: ±1, acc: 1/0}` | the last `Answer: X` in the last 300 characters equals the label, both in
  Minerva form, the label as an integer (a non-numeric label is an error) |
| `f1` | [0, 1] | SQuAD token F1 of response and label (lower-cased, punctuation and articles dropped; a
  yes/no/noanswer on one side must match exactly) |
| `gpqa` | 1 / 0 | the chosen letter equals the correct one (metadata `correct_letter`, a one-letter label, a
  choice index, or the choice text); without a letter, the correct text appears in the response |
| `ifbench` | 1 / 0 | every instruction of metadata `instruction_id_list`/`kwargs` followed (IFBench's strict
  check; needs IFBench's `evaluation_lib` importable) |
| `random` | 0 / 1 | uniformly at random |
| `deterministic_random` | 0 / 1 | (miles) first byte of sha256(str(tokens) + response), mod 2 |
| `exact_match`, `first_digit`, `char_match` | | ours (the built-in tasks) |
| `remote_rm` | the service's JSON | `POST --rm-url {prompt, response, label}` (`coordinator.rollout.remote_rm`) |
| `boxed_<t>` | as `<t>` | `<t>` applied to the last `\\boxed{}` content of the response ("" when none) |

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

from coordinator.rollout.math_grading import (
    answers_equal,
    extract_boxed,
    extract_last_number,
    label_answer,
    normalize_final_answer,
)
from replay.sample import Sample
from workers.errors import RaylessError

FIRST_DIGIT_WINDOW = 4
DAPO_TAIL_CHARS = 300
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


def _grade_boxed(solution: str, label: str) -> float:
    """slime's verl-style check: the last `\\boxed{}` of `solution` against the label's answer."""
    if not label:
        return 0.0
    answer = extract_boxed(solution)
    if answer is None:
        return 0.0
    return 1.0 if answers_equal(answer, label_answer(label)) else 0.0


def math_answer(response: str, sample: Sample) -> float:
    """slime's `math`: the last `\\boxed{}` answer only (no box: 0); no thinking delimiter needed."""
    return _grade_boxed(response, _label(sample))


def math_last_number(response: str, sample: Sample) -> float:
    """rayless' earlier `math`: the last `\\boxed{}` answer, or without one the last number of the response."""
    label = _label(sample)
    answer = extract_boxed(response)
    if answer is None:
        answer = extract_last_number(response)
    if not label or answer is None:
        return 0.0
    return 1.0 if answers_equal(answer, label_answer(label)) else 0.0


def deepscaler(response: str, sample: Sample) -> float:
    """slime's `deepscaler`: the solution is the text after the last `</think>`, else between the first two
    `###Response`; a response with neither scores 0 even when its box is right."""
    if "</think>" in response:
        solution = response.rsplit("</think>", 1)[1]
    elif "###Response" in response:
        solution = response.split("###Response")[1]
    else:
        return 0.0
    return _grade_boxed(solution, _label(sample))


def gemma_math(response: str, sample: Sample) -> float:
    """miles' `gemma_math`: as deepscaler, splitting on the last `<channel|>`, and no delimiter needed."""
    solution = response.rsplit("<channel|>", 1)[1] if "<channel|>" in response else response
    return _grade_boxed(solution, _label(sample))


def dapo(response: str, sample: Sample) -> dict[str, float]:
    """slime's `dapo` (Minerva check): `{"score": 1.0, "acc": 1.0}` when right, `{"score": -1.0, "acc": 0.0}`
    when wrong. slime also returns the prediction text; rewards here are numbers, so it is left out."""
    matches = re.findall(r"(?i)Answer\s*:\s*([^\n]+)", response[-DAPO_TAIL_CHARS:])
    prediction = normalize_final_answer(matches[-1] if matches else "[INVALID]")
    label = normalize_final_answer(_label(sample))
    try:
        truth = str(int(float(label)))  # DAPO answers are integers
    except (ValueError, OverflowError):
        raise RewardError(
            f"rm-type dapo needs an integer label (DAPO answers are integers), got {sample.label!r}"
        ) from None
    correct = prediction == truth
    return {"score": 1.0 if correct else -1.0, "acc": 1.0 if correct else 0.0}


# --------------------------------------------------------------------------------------------------- f1

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = frozenset(string.punctuation)


def normalize_f1_text(text: str) -> str:
    """SQuAD's answer normalisation: lower case, punctuation and articles removed, spaces collapsed."""
    text = "".join(char for char in text.lower() if char not in _PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def f1(response: str, sample: Sample) -> float:
    """Token F1 between the response and the label (SQuAD's), in [0, 1]."""
    prediction, truth = normalize_f1_text(response), normalize_f1_text(_label(sample))
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

_GPQA_PATTERNS = (
    re.compile(r"(?:answer|option|choice)\s*(?:is|:)?\s*([A-Z])\b", re.IGNORECASE),
    re.compile(r"\b([A-Z])\s*(?:is\s*(?:the)?\s*correct)", re.IGNORECASE),
    re.compile(r"final\s*(?:answer|option)\s*(?:is|:)?\s*([A-Z])\b", re.IGNORECASE),
)
_GPQA_DEFAULT_LETTERS = "ABCDEFGHIJ"


def _gpqa_letters(metadata: dict[str, Any]) -> str:
    valid = metadata.get("valid_letters")
    if isinstance(valid, (list, tuple, str)) and valid:
        return "".join(str(letter).strip().upper() for letter in valid)
    choices = metadata.get("choices")
    if isinstance(choices, (list, tuple, dict)) and choices:
        return string.ascii_uppercase[: len(choices)]
    return _GPQA_DEFAULT_LETTERS


def _gpqa_choice_texts(metadata: dict[str, Any]) -> list[str]:
    choices = metadata.get("choices")
    if isinstance(choices, dict):
        return [str(choices[key]) for key in sorted(choices)]
    if isinstance(choices, (list, tuple)):
        return [str(choice) for choice in choices]
    return []


def _gpqa_correct_letter(label: str, metadata: dict[str, Any], letters: str) -> str | None:
    correct = metadata.get("correct_letter")
    if isinstance(correct, str) and correct.strip().upper() in letters and len(correct.strip()) == 1:
        return correct.strip().upper()
    label = label.strip()
    if len(label) == 1 and label.upper() in letters:
        return label.upper()
    choices = _gpqa_choice_texts(metadata)
    for index, choice in enumerate(choices):
        if normalize_f1_text(choice) == normalize_f1_text(label) and normalize_f1_text(label):
            return letters[index] if index < len(letters) else None
    if label.isdigit() and int(label) < min(len(letters), len(choices) or len(letters)):
        return letters[int(label)]  # a choice index (labels travel as text here)
    return None


def _gpqa_chosen_letter(response: str, letters: str) -> str | None:
    for pattern in _GPQA_PATTERNS:
        for match in pattern.finditer(response):
            letter = match.group(1).upper()
            if letter in letters:
                return letter
    standalone = [letter for letter in re.findall(r"\b([A-Z])\b", response) if letter in letters]
    return standalone[-1] if standalone else None


def gpqa(response: str, sample: Sample) -> float:
    """slime's multiple-choice check: the letter the response chooses (after the last `</think>`) against
    the correct one; without both letters, whether the correct answer's text appears in the response."""
    metadata = sample.metadata or {}
    if "</think>" in response:
        response = response.rsplit("</think>", 1)[1]
    letters = _gpqa_letters(metadata)
    label = _label(sample)
    correct = _gpqa_correct_letter(label, metadata, letters)
    chosen = _gpqa_chosen_letter(response, letters)
    if correct is not None and chosen is not None:
        return 1.0 if chosen == correct else 0.0
    candidates = []
    choices = _gpqa_choice_texts(metadata)
    if correct is not None and letters.index(correct) < len(choices):
        candidates.append(choices[letters.index(correct)])
    candidates += [str(metadata[key]) for key in ("correct_answer", "answer_text") if metadata.get(key)]
    candidates.append(label)
    text = normalize_f1_text(response)
    return 1.0 if any(normalize_f1_text(c) and normalize_f1_text(c) in text for c in candidates) else 0.0


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


def _ifbench_kwargs(raw: Any, count: int) -> list[dict[str, Any]]:
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
    ids = [str(entry).strip() for entry in metadata.get("instruction_id_list") or [] if str(entry).strip()]
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
    digest = hashlib.sha256((str(list(sample.tokens)) + response).encode("utf-8")).digest()
    return float(digest[0] % 2)


def _remote_placeholder(response: str, sample: Sample) -> RuleResult:
    raise RewardError("rm-type remote_rm is scored by coordinator.rollout.remote_rm, not as a rule")


# ---------------------------------------------------------------------------------------------- registry

RULES: dict[str, Rule] = {
    rule.name: rule
    for rule in (
        Rule("math", math_answer),
        Rule("math_last_number", math_last_number),
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


def rm_type_names() -> list[str]:
    """Every name `--rm-type` accepts: the rules, and `boxed_<name>` for those graded on answer text."""
    names = sorted(RULES)
    return names + sorted(BOXED_PREFIX + name for name, rule in RULES.items() if rule.boxed_variant)


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
        response = extract_boxed(response) or ""
    return rule.score(response, sample)
