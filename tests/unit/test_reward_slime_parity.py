"""slime's results under slime's names where rayless' lenient grading differed, our two documented
deviations from slime (docs/rewards.md, "Where we differ from slime"), and `math_verify`.

Values under slime's names are what slime's own code returns (THUDM/slime 624b824a,
`slime/rollout/rm_hub/math_utils.py` and `gpqa.py`), as in test_reward_corpus.py.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest

from coordinator.rewards.math_normalize import last_boxed
from coordinator.rewards.math_verify_rule import math_verify_library
from coordinator.rewards.rules import RewardError, apply_rule, require_libraries
from replay.sample import Sample, SampleStatus


def score(rm_type: str, response: str, label: Any = None, **metadata: Any) -> Any:
    return apply_rule(rm_type, Sample(group_index=0, sample_index=0, prompt="q", tokens=[1, 2, 3],
                                      response_length=0, loss_mask=[], rollout_log_probs=[],
                                      status=SampleStatus.COMPLETED, label=label, response=response,
                                      metadata=metadata))


# ---------------------------------------------------------------------------- slime's results, our deviations

# The issue's classes (1-4): rayless' lenient grading accepted these; slime's `math` does not (values: slime's
# own code, THUDM/slime 624b824a math_utils.grade_answer_verl), and `math_lenient` keeps the old verdict.
STRICTER_THAN_LENIENT = [
    (r"\boxed{2+3}", "5"),  # 1: unevaluated arithmetic: an integer label wants the integer
    (r"\boxed{7 \cdot 8}", "56"),
    (r"\boxed{\frac{6}{3}}", "2"),
    (r"\boxed{\frac{2}{4}}", r"\frac{1}{2}"),  # 2: an unreduced fraction is not the reduced one
    (r"\boxed{2/4}", r"\frac{1}{2}"),
    (r"\boxed 42", "42"),  # 3: the box needs braces
    (r"\fbox{42}", "42"),
    (r"\boxed{42} and so \boxed{4", "42"),  # the last box is cut off: the final answer is unknown
]


@pytest.mark.parametrize(("response", "label"), STRICTER_THAN_LENIENT)
def test_math_is_slimes_and_math_lenient_is_ours(response: str, label: str) -> None:
    assert score("math", response, label) == 0.0
    assert score("math_lenient", response, label) == 1.0


@pytest.mark.parametrize(("response", "label", "expected"), [
    (r"\boxed{monday}", "Monday", 1.0),  # 4: text is compared lower-cased
    (r"\boxed{\text{no solution}}", r"\text{No solution}", 1.0),
    (r"\boxed{(B)}", "B", 1.0),
    (r"\boxed{1{,}000}", "1000", 1.0),
    (r"\boxed{\mathbf{5}}", "5", 1.0),
    (r"\boxed{5 \text{ cm}^2}", "5", 1.0),
    (r"\boxed{\begin{bmatrix}1\\2\end{bmatrix}}", r"\begin{pmatrix}1\\2\end{pmatrix}", 1.0),
    (r"\boxed{2\frac{1}{2}}", r"\frac{5}{2}", 1.0),  # a mixed number is 2 + 1/2 ...
    (r"\boxed{2\frac{1}{2}}", "1", 0.0),  # ... not 2 × 1/2
    (r"\boxed{3, 5}", "3 and 5", 1.0),
])
def test_math_reads_forms_as_slime_does(response: str, label: str, expected: float) -> None:
    """Class 4: forms rayless' lenient grading misread."""
    assert score("math", response, label) == expected


def test_slimes_box_rule() -> None:
    assert last_boxed(r"\boxed{1} then \boxed{\frac{1}{2}}") == r"\frac{1}{2}"
    assert last_boxed(r"\boxed{a_{i}^{2}}") == "a_{i}^{2}"
    assert last_boxed(r"\boxed 5") is None and last_boxed(r"\fbox{5}") is None
    assert last_boxed(r"\boxed{5} \boxed{6") is None  # no falling back to an earlier box
    assert last_boxed("\\boxed{" * 5_000 + "5}") == "5"


def test_deviation_math_numeric_zero_label() -> None:
    """slime's `if not ground_truth` makes a numeric label 0 unreachable; ours grades it as "0"."""
    assert score("math", r"so \boxed{0}", 0) == 1.0  # slime: 0
    assert score("math", r"so \boxed{0}", 0.0) == 1.0  # slime: 0
    assert score("math", r"so \boxed{1}", 0) == 0.0
    assert score("math", r"so \boxed{0}", "0") == 1.0  # slime agrees on text "0"
    assert score("math", r"so \boxed{0}", "") == 0.0 and score("math", r"so \boxed{False}", False) == 0.0


@pytest.mark.parametrize(("response", "label", "metadata", "slimes"), [
    ("The answer is clearly B", "B", {}, 0.0),  # slime reads C (the c of "clearly")
    ("The answer is (B)", "B", {}, 0.0),  # slime reads I (the i of "is", a valid letter in A-J)
    ("The answer is: B", "B", {}, 0.0),
    ("data is correct, so B", "B", {}, 0.0),  # slime reads A (the a of "data")
])
def test_deviation_gpqa_letter_inside_a_word(response: str, label: str, metadata: dict[str, Any],
                                             slimes: float) -> None:
    assert score("gpqa", response, label, **metadata) == 1.0 != slimes


@pytest.mark.parametrize(("response", "label", "metadata", "expected"), [
    ("The answer is E", "A", {"choices": ["a", "b", "c", "d"]}, 1.0),  # the choice "a" inside "answer"
    ("The answer is 150", "15", {}, 1.0),
    ("the mitochondrial matrix", "mitochondria", {}, 1.0),
    ("15 ms", "1.5 m/s", {}, 0.0),  # `1 5 m s` is not in `15 ms`
])
def test_gpqa_text_is_found_as_a_substring_as_slime_does(response: str, label: str, metadata: dict[str, Any],
                                                        expected: float) -> None:
    """slime's quirk kept (not among the issue's plainly-wrong cases): the answer text counts as a substring."""
    assert score("gpqa", response, label, **metadata) == expected


def test_f1_needs_a_text_label() -> None:
    with pytest.raises(RewardError, match="rm-type f1 needs a text label, got int 5"):
        score("f1", "5", 5)


def test_deepscaler_refuses_a_label_it_cannot_read() -> None:
    with pytest.raises(RewardError, match="rm-type deepscaler: the label must be text or a number"):
        score("deepscaler", r"</think>\boxed{5}", ["5"])


# ----------------------------------------------------------------------------------------------- math_verify

MATH_VERIFY_CASES = [
    (r"so \boxed{\frac{1}{2}}", "0.5", 1.0),
    (r"\boxed{2+3}", "5", 1.0),  # Math-Verify evaluates
    (r"The answer is $\frac{2}{4}$", r"\frac12", 1.0),
    (r"\boxed{(1,2)}", "(1,2)", 1.0),  # a bare label is read as LaTeX: an interval
    (r"\boxed{(1,2]}", "(1,2)", 0.0),
    (r"\boxed{7}", "8", 0.0),
    ("I think it is 42", "42", 1.0),
    ("no answer at all", "3", 0.0),
    (r"\boxed{2\sqrt{2}}", r"\sqrt{8}", 1.0),
    (r"\boxed{x^2+2x+1}", "(x+1)^2", 1.0),
    (r"\boxed{\sqrt{3}}", r"\sqrt{2}", 0.0),
]


@pytest.mark.parametrize(("response", "label", "expected"), MATH_VERIFY_CASES)
def test_math_verify_on_known_right_and_wrong_answers(response: str, label: str, expected: float) -> None:
    pytest.importorskip("math_verify", reason="Math-Verify is the math-verify extra (in dev)")
    assert score("math_verify", response, label) == expected


def test_math_verify_works_off_the_main_thread() -> None:
    pytest.importorskip("math_verify", reason="Math-Verify is the math-verify extra (in dev)")
    results: list[float] = []
    worker = threading.Thread(target=lambda: results.append(score("math_verify", r"\boxed{3}", "3")))
    worker.start()
    worker.join(timeout=60)
    assert results == [1.0]


def test_math_verify_missing_says_which_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(__import__("sys").modules, "math_verify", None)  # an import of it fails
    math_verify_library.cache_clear()
    try:
        with pytest.raises(RewardError, match=r"pip install 'rayless\[math-verify\]'"):
            require_libraries("math_verify")
        with pytest.raises(RewardError, match="needs Hugging Face's Math-Verify"):
            score("boxed_math_verify", r"\boxed{3}", "3")
        require_libraries("math")  # no package needed
    finally:
        math_verify_library.cache_clear()
