"""slime's reward names give slime's rewards: a corpus of 948 response/label pairs with upstream's own values.

`tests/data/reward_corpus.jsonl`, one case a line: `rm_type`, `response`, `label` (its JSON type kept: slime
treats `0` and `"0"` differently), `metadata`, `tokens` (deterministic_random), the issue's `class` (1
unevaluated arithmetic, 2 unreduced fractions, 3 finding the answer, 4 forms, 5 where slime itself is wrong),
`upstream` and `upstream_value`, `expected` (ours) and `deviation`.

`upstream_value` is what slime's own rm_hub code returns (THUDM/slime at 624b824a898ab0ec1fcb4d373004c7f3852bf515:
`slime/rollout/rm_hub/__init__.py` `async_rm` dispatching to `math_utils.grade_answer_verl`,
`deepscaler.get_deepscaler_rule_based_reward`, `math_dapo_utils.compute_score`, `f1.f1_score`,
`gpqa.compute_gpqa_reward`), or miles' for its own names (radixark/miles at
31f1ca961a94cb860cec3b2dea34ec332bfa8f76: `miles/rollout/rm_hub/deepscaler.get_gemma_math_reward`, and
`async_rm`'s `deterministic_random`). The values were worked out from that code and confirmed by running those
files themselves (pure Python: sympy and pylatexenc), outside the repository. `miles_value` appears where miles'
own code (same commit) gives another value than slime's for a slime name (miles' gpqa letters default to A-H,
and miles' sympy names include Python's `all`/`id`).

Every case must agree with upstream except the documented deviations (docs/rewards.md, one row each):
`math_numeric_zero_label`, `gpqa_letter_inside_a_word`.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from coordinator.rewards.rules import apply_rule
from replay.sample import Sample, SampleStatus
from tests.support import upstream_rm_hub

CORPUS = Path(__file__).resolve().parents[1] / "data" / "reward_corpus.jsonl"
DEVIATIONS = {"math_numeric_zero_label", "gpqa_letter_inside_a_word"}
CASES = [json.loads(line) for line in CORPUS.read_text(encoding="utf-8").splitlines() if line.strip()]


def _sample(case: dict[str, Any]) -> Sample:
    return Sample(group_index=0, sample_index=case["id"], prompt="q", tokens=case.get("tokens") or [1, 2, 3],
                  response_length=0, loss_mask=[], rollout_log_probs=[], status=SampleStatus.COMPLETED,
                  label=case["label"], response=case["response"], metadata=dict(case["metadata"]))


def test_the_corpus_covers_every_class_and_name() -> None:
    assert len(CASES) >= 300
    classes = Counter(case["class"] for case in CASES)
    assert set(classes) == {1, 2, 3, 4, 5} and min(classes.values()) >= 30
    names = {case["rm_type"] for case in CASES}
    assert {"math", "deepscaler", "gemma_math", "dapo", "f1", "gpqa", "deterministic_random"} <= names
    assert any(name.startswith("boxed_") for name in names)


def test_only_documented_deviations_differ_from_upstream() -> None:
    for case in CASES:
        if case["deviation"] is None:
            assert case["expected"] == case["upstream_value"], case
        else:
            assert case["deviation"] in DEVIATIONS and case["expected"] != case["upstream_value"], case
    assert {case["deviation"] for case in CASES} == DEVIATIONS | {None}


def test_every_case_gives_the_expected_reward() -> None:
    wrong = []
    for case in CASES:
        got = apply_rule(case["rm_type"], _sample(case))
        if got != case["expected"]:
            wrong.append((case["id"], case["rm_type"], case["response"], case["label"], got, case["expected"]))
    assert wrong == []


@pytest.mark.parametrize(("variable", "source"), [("RAYLESS_SLIME_RM_HUB", "slime 624b824a"),
                                                  ("RAYLESS_MILES_RM_HUB", "miles 31f1ca96")])
def test_the_recorded_values_are_upstreams_own(variable: str, source: str) -> None:
    """Runs upstream's own graders on every case when their files are at hand (tests/support/upstream_rm_hub.py
    says how): the recorded `upstream_value` (`miles_value` where miles differs) is what they return."""
    hub = upstream_rm_hub.load(variable)
    if hub is None:
        pytest.skip(f"{variable} is not set: upstream's rm_hub files are not part of the repository")
    checked = 0
    for case in CASES:
        if source.startswith("slime") and case["upstream"] != source:
            continue  # miles' own names: slime has no gemma_math or deterministic_random
        recorded = case.get("miles_value", case["upstream_value"]) if source.startswith("miles") else (
            case["upstream_value"])
        got = upstream_rm_hub.score(hub, case["rm_type"], case["response"], case["label"],
                                    json.loads(json.dumps(case["metadata"])), case.get("tokens") or [1, 2, 3])
        assert got == recorded, case
        checked += 1
    assert checked >= 300
