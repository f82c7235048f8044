"""pass@k as slime computes it: the unbiased estimator on known answers, the mean over groups, and the ragged
rule (a group counts for k only with at least k samples)."""

from __future__ import annotations

import itertools
import math

import pytest

from coordinator.rewards.pass_rate import pass_at_k, pass_rates


def brute_force_pass_at_k(rewards: list[float], k: int) -> float:
    """The share of all k-subsets of the samples holding at least one right answer."""
    subsets = list(itertools.combinations(rewards, k))
    return sum(any(r >= 1.0 for r in subset) for subset in subsets) / len(subsets)


@pytest.mark.parametrize("rewards", [[1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 0, 0, 0, 0, 0, 0], [0.5, 1, 0, 1],
                                     [1, 1, 1, 1]])
def test_the_estimator_equals_counting_every_subset(rewards: list[float]) -> None:
    correct = sum(r >= 1.0 for r in rewards)
    for k in range(1, len(rewards) + 1):
        assert math.isclose(pass_at_k(len(rewards), correct, k), brute_force_pass_at_k(rewards, k))


def test_known_values_and_the_mean_over_groups() -> None:
    # one right of four: pass@1 = 1/4, pass@2 = 1 - C(3,2)/C(4,2) = 1/2, pass@4 = 1; a group with none: all 0
    rates = pass_rates([[1, 0, 0, 0], [0, 0, 0, 0]])
    assert rates == {1: 0.125, 2: 0.25, 4: 0.5}
    assert pass_rates([[0.9, 0.99]]) == {1: 0.0, 2: 0.0}  # only a reward of 1 counts as right


def test_groups_of_one_give_nothing_and_small_groups_sit_out_large_k() -> None:
    assert pass_rates([[1.0], [0.0]]) == {}
    assert pass_rates([]) == {}
    # a filtered batch: the 2-sample group counts for k = 1, 2 only
    rates = pass_rates([[1, 0], [0, 0, 0, 1]])
    assert rates[1] == (0.5 + 0.25) / 2 and rates[2] == (1.0 + 0.5) / 2 and rates[4] == 1.0
