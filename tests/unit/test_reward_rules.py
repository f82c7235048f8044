"""The built-in reward types on known right and wrong answers (tables), and the math grading under them.

The cases come from slime's rules (slime's rm_hub at THUDM/slime 624b824a; every value under a slime name is
what slime's own code returns, as in test_reward_corpus.py: deepscaler without `</think>` scores 0; dapo's
non-numeric label; `math` takes the boxed answer only, `math_last_number` also the last number). The few
places where we differ from slime on purpose have their own tests here (docs/rewards.md lists them).
"""

from __future__ import annotations

import hashlib
from typing import Any

import pytest

from coordinator.rewards.math_grading import (
    answers_equal,
    extract_boxed,
    extract_last_number,
    symbolically_equal,
)
from coordinator.rewards.minerva import minerva_form
from coordinator.rewards.rules import (
    RULES,
    RewardError,
    apply_rule,
    base_rule,
    ifbench_library,
    rm_type_names,
)
from replay.sample import Sample, SampleStatus


def sample(response: str, label: str | None = None, metadata: dict[str, Any] | None = None,
           tokens: list[int] | None = None) -> Sample:
    return Sample(group_index=0, sample_index=0, prompt="q", tokens=tokens or [1, 2, 3], response_length=0,
                  loss_mask=[], rollout_log_probs=[], status=SampleStatus.COMPLETED, label=label,
                  response=response, metadata=metadata or {})


def score(rm_type: str, response: str, label: str | None = None, **metadata: Any) -> Any:
    return apply_rule(rm_type, sample(response, label, metadata))


# --------------------------------------------------------------------------------------------- math family

MATH_CASES = [
    # (response, label, math, math_last_number)
    (r"... so \boxed{34}", "34", 1.0, 1.0),
    (r"so \boxed{34}", r"\boxed{34}", 1.0, 1.0),  # a boxed label: its content
    (r"\boxed{\frac{1}{2}}", "0.5", 1.0, 1.0),
    ("the answer is 34", "34", 0.0, 1.0),  # no box: slime's math says 0, the last number says 34
    ("we tried 5 and then 3", "5", 0.0, 0.0),
    (r"\boxed{35}", "34", 0.0, 0.0),
    (r"first \boxed{5} then \boxed{6}", "6", 1.0, 1.0),
    (r"first \boxed{5} then \boxed{6}", "5", 0.0, 0.0),
    (r"\boxed{\dfrac{3}{4}}", "3/4", 1.0, 1.0),
    (r"\boxed{\dfrac{3}{4}}", "0.75", 1.0, 1.0),
    (r"\boxed{\frac12}", "1/2", 1.0, 1.0),
    (r"\boxed{-\frac{2}{4}}", "-0.5", 1.0, 1.0),
    (r"\boxed{1,000}", "1000", 1.0, 1.0),
    (r"\boxed{x = 7}", "7", 1.0, 1.0),
    (r"\boxed{7.0}", "7", 1.0, 1.0),
    (r"\boxed{7.5}", "7", 0.0, 0.0),  # an integer never equals a non-integer
    (r"\boxed{0.3333333}", "1/3", 0.0, 0.0),  # exact values only, no tolerance
    (r"\boxed{50\%}", "50", 1.0, 1.0),  # % is dropped (slime)
    (r"\boxed{90^\circ}", "90", 1.0, 1.0),
    (r"\boxed{5\text{ cm}}", "5", 1.0, 1.0),
    (r"\boxed{\text{(B)}}", "(B)", 1.0, 1.0),
    (r"\boxed{$12$}", "12", 1.0, 1.0),
    (r"\boxed{2\sqrt{2}}", r"\sqrt{8}", 1.0, 1.0),  # symbolic
    (r"\boxed{\sqrt{3}}", r"\sqrt{2}", 0.0, 0.0),
    (r"\boxed{2x+1}", "1+2x", 1.0, 1.0),
    (r"\boxed{\frac{\pi}{2}}", r"\pi/2", 1.0, 1.0),
    (r"\boxed{(1, 2]}", "(1,2]", 1.0, 1.0),  # intervals element-wise, brackets must match
    (r"\boxed{(1, 2)}", "(1,2]", 0.0, 0.0),
    (r"\boxed{(1, \frac{1}{2})}", "(1, 0.5)", 1.0, 1.0),
    (r"\boxed{}", "5", 0.0, 0.0),
    (r"\boxed{5}", "", 0.0, 0.0),
    ("2e3", "2000", 0.0, 1.0),
]


@pytest.mark.parametrize(("response", "label", "expected_math", "expected_last"), MATH_CASES)
def test_math_takes_the_boxed_answer_only_and_math_last_number_also_the_last_number(
    response: str, label: str, expected_math: float, expected_last: float
) -> None:
    assert score("math", response, label) == expected_math
    assert score("math_last_number", response, label) == expected_last


DEEPSCALER_CASES = [
    (r"<think>reasoning</think> so \boxed{34}", "34", 1.0),
    (r"\boxed{34}", "34", 0.0),  # the trap: a right box without </think> scores 0
    ("<think>x</think> 34", "34", 0.0),  # no box after the delimiter
    (r"<think>\boxed{34}</think> the answer is 34", "34", 0.0),  # the box must follow the last </think>
    (r"<think>a</think> \boxed{1} <think>b</think> \boxed{34}", "34", 1.0),
    (r"###Response \boxed{34} ###Response \boxed{35}", "34", 1.0),  # between the first two ###Response
    (r"<think>x</think> \boxed{\frac{1}{2}}", r"\boxed{0.5}", 1.0),
    (r"<think>x</think> \boxed{35}", "34", 0.0),
    (r"<think>x</think> \boxed{34}", "", 0.0),
]


@pytest.mark.parametrize(("response", "label", "expected"), DEEPSCALER_CASES)
def test_deepscaler_needs_a_thinking_delimiter(response: str, label: str, expected: float) -> None:
    assert score("deepscaler", response, label) == expected


@pytest.mark.parametrize(("response", "label", "expected"), [
    (r"<channel|> \boxed{34}", "34", 1.0),
    (r"\boxed{34}", "34", 1.0),  # gemma_math needs no delimiter
    (r"\boxed{34}<channel|> \boxed{35}", "34", 0.0),
])
def test_gemma_math(response: str, label: str, expected: float) -> None:
    assert score("gemma_math", response, label) == expected


# ------------------------------------------------------------------------------------------------- dapo

RIGHT, WRONG = {"score": 1.0, "acc": 1.0}, {"score": -1.0, "acc": 0.0}
DAPO_CASES = [
    ("reasoning...\nAnswer: 34", "34", RIGHT),
    ("Answer: 35", "34", WRONG),
    (r"\boxed{34}", "34", WRONG),  # no `Answer:` line: [INVALID]
    ("answer :  34", "34.0", RIGHT),  # case-insensitive; the label through int(float(...))
    ("Answer: 1,000", "1000", RIGHT),
    ("Answer: $34$", "34", RIGHT),
    ("Answer: x = 34", "34", RIGHT),  # the text after the last '='
    ("Answer: 34 dollars", "34", RIGHT),
    ("Answer: 12\nthen more\nAnswer: 34", "34", RIGHT),  # the last match
    ("Answer: 34\n" + "x" * 400, "34", WRONG),  # only the last 300 characters are read
    ("Answer: 34.", "34", WRONG),  # a trailing period is not removed (Minerva's rule)
]


@pytest.mark.parametrize(("response", "label", "expected"), DAPO_CASES)
def test_dapo(response: str, label: str, expected: dict[str, float]) -> None:
    assert score("dapo", response, label) == expected


def test_dapo_refuses_a_non_numeric_label() -> None:
    with pytest.raises(RewardError, match=r"rm-type dapo needs an integer label .*got 'x\+1'"):
        score("dapo", "Answer: x+1", "x+1")


def test_minerva_normalisation() -> None:
    assert minerva_form(r"\text{5 } \text{ways}") == "5"
    assert minerva_form(r"\frac12") == r"\frac{1}{2}"
    assert minerva_form(r"\sqrt3") == r"\sqrt{3}"
    assert minerva_form(r"\boxed{12}") == "12"
    assert minerva_form("an 5") == "5" and minerva_form("Thousands of ways") == "Thousandsof"  # plain edits


# ---------------------------------------------------------------------------------------------- f1, gpqa

F1_CASES = [
    ("The Eiffel Tower", "eiffel tower", 1.0),
    ("Paris France", "Paris", pytest.approx(2 / 3)),
    ("yes", "no", 0.0),
    ("yes", "yes", 1.0),
    ("no answer here", "noanswer", 0.0),
    ("completely different", "eiffel tower", 0.0),
    ("an apple, a pear!", "Apple pear", 1.0),
]


@pytest.mark.parametrize(("response", "label", "expected"), F1_CASES)
def test_f1(response: str, label: str, expected: float) -> None:
    assert score("f1", response, label) == expected


GPQA_CASES: list[tuple[str, Any, dict[str, Any], float]] = [
    ("The answer is C", "C", {}, 1.0),
    ("The answer is C", "B", {}, 0.0),
    ("Answer: D", None, {"correct_letter": "D"}, 1.0),
    ("<think>maybe A</think> Final answer: B", "B", {}, 1.0),  # only the text after </think>
    ("The answer is B", 2, {"choices": ["x", "y", "z"]}, 0.0),  # a numeric label is an index: 2 → C
    ("The answer is C", 2, {"choices": ["x", "y", "z"]}, 1.0),
    ("The answer is B", 1.0, {}, 1.0),  # a float index too (slime's int(label))
    ("The answer is C", "2", {"choices": ["x", "y", "z"]}, 0.0),  # the text "2" is no index (slime)
    ("The answer is B", "y", {"choices": ["x", "y", "z"]}, 1.0),  # the label is a choice's text
    ("The answer is A", "y", {"choices": {"k2": "x", "k1": "y"}}, 0.0),  # a dict's values in order: y is B
    ("it is the mitochondria", "mitochondria", {}, 1.0),  # no letter: the text appears
    ("it is the nucleus", "mitochondria", {}, 0.0),
    ("15 ms", "1.5 m/s", {}, 0.0),  # punctuation is a separator, not dropped: `1 5 m s`
    ("The answer is I", "I", {}, 1.0),  # A-J by default (miles': A-H)
]


@pytest.mark.parametrize(("response", "label", "metadata", "expected"), GPQA_CASES)
def test_gpqa(response: str, label: str | None, metadata: dict[str, Any], expected: float) -> None:
    assert score("gpqa", response, label, **metadata) == expected


# ------------------------------------------------------------------------------------------ boxed variants

BOXED_CASES = [
    ("boxed_f1", r"blah \boxed{New York}", "new york", 1.0),
    ("boxed_f1", "New York, no box", "new york", 0.0),  # no box: the response is ""
    ("boxed_exact_match", r"it is \boxed{42}", "42", 1.0),
    ("boxed_exact_match", "42", "42", 0.0),
    ("boxed_gpqa", r"A? no: \boxed{C}", "C", 1.0),
    ("boxed_math_last_number", r"it is \boxed{7}", "7", 1.0),
    ("boxed_math", r"it is \boxed{7}", "7", 0.0),  # `math` then looks for a box inside the box's content
    ("boxed_f1", r"\fbox{7}", "7", 0.0),  # slime's box rule: `\fbox` is no box
]


@pytest.mark.parametrize(("rm_type", "response", "label", "expected"), BOXED_CASES)
def test_boxed_variants_grade_the_boxed_answer(rm_type: str, response: str, label: str, expected: float) -> None:
    assert score(rm_type, response, label) == expected


def test_names_cover_every_script_and_refuse_unknown_ones() -> None:
    names = rm_type_names()
    for name in ("deepscaler", "dapo", "math", "f1", "gpqa", "ifbench", "remote_rm", "random", "boxed_math",
                 "boxed_f1", "gemma_math", "deterministic_random", "first_digit"):
        assert name in names
    assert "boxed_random" not in names and "boxed_remote_rm" not in names
    with pytest.raises(RewardError, match="'boxed_random' is not a built-in reward"):
        base_rule("boxed_random")
    with pytest.raises(RewardError, match="'mathh' is not a built-in reward; known: char_match"):
        base_rule("mathh")
    assert base_rule("boxed_f1") == (RULES["f1"], True)


# ----------------------------------------------------------------------------------- random, ours, ifbench


def test_random_and_deterministic_random() -> None:
    draws = {score("random", "anything") for _ in range(200)}
    assert draws == {0.0, 1.0}
    tokens = [5, 6, 7]
    expected = float(hashlib.sha256((str(tokens) + "resp").encode()).digest()[0] % 2)
    values = {apply_rule("deterministic_random", sample("resp", tokens=tokens)) for _ in range(5)}
    assert values == {expected}
    outcomes = {apply_rule("deterministic_random", sample(f"r{i}", tokens=tokens)) for i in range(64)}
    assert outcomes == {0.0, 1.0}


@pytest.mark.parametrize(("rm_type", "response", "label", "expected"), [
    ("first_digit", "3333333", "3", 1.0), ("first_digit", "3x3y", "3", 0.5), ("first_digit", "", "3", 0.0),
    ("first_digit", " 333", "3", 0.75), ("exact_match", "  42\n", "42", 1.0), ("exact_match", "42.", "42", 0.0),
    ("char_match", "371=", "371", 1.0), ("char_match", "173", "371", pytest.approx(1 / 3)),
])
def test_our_task_rewards(rm_type: str, response: str, label: str, expected: float) -> None:
    assert score(rm_type, response, label) == expected


def test_our_task_rewards_refuse_bad_labels() -> None:
    with pytest.raises(RewardError, match="one-character label"):
        score("first_digit", "3333", "33")
    with pytest.raises(RewardError, match="non-empty label"):
        score("char_match", "3", "")


def test_ifbench_without_ifbench_installed_says_how_to_get_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(__import__("sys").modules, "evaluation_lib", None)  # an import of it fails
    ifbench_library.cache_clear()
    try:
        assert score("ifbench", "text") == 0.0  # no instructions in the metadata: 0, IFBench not needed
        with pytest.raises(RewardError, match=r"needs IFBench's evaluation_lib: `git clone"):
            score("ifbench", "text", instruction_id_list=["punctuation:no_comma"])
    finally:
        ifbench_library.cache_clear()


def test_ifbench_maps_metadata_to_ifbench_inputs(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    """FAKE evaluation_lib (IFBench cannot be fetched here): it records what our rule hands to IFBench's two
    entry points, and follows an instruction `no_comma` as the real checker does."""
    (tmp_path / "evaluation_lib.py").write_text(
        "from dataclasses import dataclass\n"
        "SEEN = []\n"
        "@dataclass\n"
        "class InputExample:\n"
        "    key: int\n    instruction_id_list: list\n    prompt: str\n    kwargs: list\n"
        "class Output:\n"
        "    def __init__(self, ok): self.follow_all_instructions = ok\n"
        "def test_instruction_following_strict(inp, prompt_to_response):\n"
        "    SEEN.append((inp, prompt_to_response))\n"
        "    return Output(',' not in prompt_to_response[inp.prompt])\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(__import__("sys").modules, "evaluation_lib", raising=False)
    ifbench_library.cache_clear()
    try:
        metadata = {"instruction_id_list": ["punctuation:no_comma", " ", None, "x:y"], "prompt_text": "Write.",
                    "record_id": 7, "kwargs": [{"a": 1, "b": None}]}
        assert score("ifbench", "no commas here", **metadata) == 1.0
        assert score("ifbench", "a, b", **metadata) == 0.0
        example, mapping = ifbench_library().SEEN[0]
        assert example.key == 7 and example.instruction_id_list == ["punctuation:no_comma", "x:y"]
        assert example.kwargs == [{"a": 1}, {"a": 1}] and mapping == {"Write.": "no commas here"}
    finally:
        ifbench_library.cache_clear()


# ------------------------------------------------------------------------------------------ math grading


@pytest.mark.parametrize(("text", "content"), [
    (r"so \boxed{42}.", "42"),
    (r"\boxed{1} then \boxed{\frac{1}{2}}", r"\frac{1}{2}"),
    (r"\boxed{\{1, 2\}}", r"\{1, 2\}"),
    (r"\boxed{a_{i}^{2}}", "a_{i}^{2}"),
    (r"\fbox{7}", "7"),
    (r"$\boxed 5$", "5"),
    (r"\boxed{12", None),
    ("no box", None),
])
def test_extract_boxed(text: str, content: str | None) -> None:
    assert extract_boxed(text) == content


def test_extract_last_number() -> None:
    assert extract_last_number("first 12 then 1,234.5 apples") == "1,234.5"
    assert extract_last_number("The answer is -7.") == "-7"
    assert extract_last_number("nothing numeric") is None


def test_symbolic_check_reads_only_small_safe_expressions() -> None:
    assert symbolically_equal(r"\frac{\sqrt{3}}{2}", r"\frac{1}{2}\sqrt{3}")
    assert not symbolically_equal("x+y+z", "z+y+x")  # three variables: not simplified
    assert not symbolically_equal("2^{100}", "2^{100}")  # a big exponent is refused
    assert not symbolically_equal("__import__('os')", "1")  # not our syntax: nothing is evaluated
    assert not symbolically_equal("x" * 200, "x" * 200)


def test_grading_survives_hostile_responses() -> None:
    # Beyond int()'s digit limit and float range: not numbers, so compared as text (and no exception).
    assert score("math_last_number", "1" * 100_000, "1") == 0.0
    assert score("math", r"\boxed{1e999999}", "1") == 0.0
    assert score("math", r"\boxed{1e999999}", "1e999999") == 1.0
    # Thousands of unclosed boxes: the innermost closed one is the answer (found in one pass over the text).
    assert score("math", "\\boxed{" * 5_000 + "5}", "5") == 1.0
    assert score("math", "\\boxed{" * 5_000, "5") == 0.0
    assert not answers_equal(r"\frac" * 5_000, "1")
