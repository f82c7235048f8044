"""The boxed-answer math reward types as slime and miles compute them: `math`, `deepscaler`, `gemma_math`.

Owns where each type finds the solution and how it reads the label; the answer check is `math_equal`, the box
`math_normalize.last_boxed`. The rules are slime's `rm_hub/__init__.py`, `math_utils.grade_answer_verl` and
`deepscaler.py` (THUDM/slime 624b824a) and miles' `deepscaler.get_gemma_math_reward` (radixark/miles 31f1ca96):

- `math`: the last `\\boxed{}` of the whole response; a label containing `\\boxed` is reduced to its last box.
  slime scores an empty or false label 0, and so a numeric label `0` too (`if not ground_truth`): plainly a
  bug (the answer 0 can never be right), so here a numeric 0 is graded as the text "0" (docs/rewards.md);
- `deepscaler`: the text after the last `</think>`, else between the first two `###Response`; neither: 0;
  a label of another type than text or number is an error (slime asserts);
- `gemma_math`: as `deepscaler`, on the text after the last `<channel|>` (the whole response without one),
  parsed with sympy's default names (miles' parser).

Invariant: pure functions of (response, label); 1.0 or 0.0.
"""

from __future__ import annotations

from coordinator.rewards.math_equal import answer_matches
from coordinator.rewards.math_normalize import BOXED, last_boxed
from workers.boundary.json_input import JsonValue
from workers.errors import RaylessError


class MathLabelError(RaylessError, ValueError):
    """A label of a type the math rules cannot read (not text or a number)."""


def _is_numeric_zero(label: JsonValue) -> bool:
    return isinstance(label, (int, float)) and not isinstance(label, bool) and label == 0


def math_reward(response: str, label: JsonValue) -> float:
    """slime's `math` (`grade_answer_verl`), with a numeric label 0 graded as "0"."""
    if not label and not _is_numeric_zero(label):
        return 0.0
    truth: str | None = str(label)
    if BOXED in truth:
        truth = last_boxed(truth)
    given = last_boxed(response)
    if given is None:
        return 0.0
    return 1.0 if answer_matches(given, truth) else 0.0


def _boxed_solution_reward(solution: str, label: JsonValue, *, sympy_defaults: bool) -> float:
    given = last_boxed(solution)
    if given is None or (isinstance(label, str) and label == ""):
        return 0.0
    if not isinstance(label, (str, int, float)):
        raise MathLabelError(f"the label must be text or a number, got {type(label).__name__} {label!r}")
    truth: str | None = str(label)
    if BOXED in truth:
        truth = last_boxed(truth)
        if truth is None:
            return 0.0
    return 1.0 if answer_matches(given, truth, sympy_defaults=sympy_defaults) else 0.0


def deepscaler_reward(response: str, label: JsonValue) -> float:
    """slime's `deepscaler`: the box after the thinking; without `</think>` or `###Response`, 0."""
    if "</think>" in response:
        solution = response.split("</think>")[-1]
    elif "###Response" in response:
        solution = response.split("###Response")[1]
    else:
        return 0.0
    return _boxed_solution_reward(solution, label, sympy_defaults=False)


def gemma_math_reward(response: str, label: JsonValue) -> float:
    """miles' `gemma_math`: the box after the last `<channel|>` (Gemma's end of thinking)."""
    solution = response.split("<channel|>")[-1]
    return _boxed_solution_reward(solution, label, sympy_defaults=True)


def boxed_content(response: str) -> str:
    """What a `boxed_<type>` reward grades: the last box's content by slime's rule ("" when there is none)."""
    return last_boxed(response) or ""
