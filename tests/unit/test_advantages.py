"""Advantage estimators (numerics, aborted samples, dict rewards) and the dynamic-sampling filters."""

from __future__ import annotations

import math
import statistics
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from coordinator.rollout.advantages import AdvantageError, compute_advantages
from coordinator.rollout.filters import DynamicFilter, FilterError, FilterResult, reward_std_positive
from replay.sample import Reward, Sample, SampleStatus
from workers.hook_loading import HookLoadError


def make_sample(
    group_index: int, sample_index: int, reward: Reward, status: SampleStatus = SampleStatus.COMPLETED
) -> Sample:
    return Sample(
        group_index=group_index,
        sample_index=sample_index,
        prompt="p",
        tokens=[1, 2],
        response_length=1,
        loss_mask=[1],
        rollout_log_probs=[0.0],
        reward=reward,
        status=status,
    )


def make_groups(*rewards: list[Reward]) -> list[list[Sample]]:
    return [[make_sample(g, s, r) for s, r in enumerate(group)] for g, group in enumerate(rewards)]


def advantages(groups: list[list[Sample]]) -> list[list[float]]:
    return [[sample.advantage for sample in group] for group in groups]


def test_grpo_normalised_matches_formula() -> None:
    groups = make_groups([1.0, 0.0, 0.0, 1.0], [0.25, 0.5, 1.0, 0.75])
    compute_advantages(groups, estimator="grpo", normalize_std=True)
    for group in groups:
        rewards = [sample.scalar_reward() for sample in group]
        mean, std = statistics.mean(rewards), statistics.stdev(rewards)
        assert [sample.advantage for sample in group] == pytest.approx(
            [(r - mean) / (std + 1e-6) for r in rewards]
        )
    # [1, 0, 0, 1]: mean 0.5, sample std 1/sqrt(3).
    assert groups[0][0].advantage == pytest.approx(0.5 * math.sqrt(3), rel=1e-5)


def test_grpo_without_std_is_mean_centred() -> None:
    groups = make_groups([3.0, 1.0], [2.0, 2.0, 5.0])
    compute_advantages(groups, estimator="grpo", normalize_std=False)
    assert advantages(groups) == [[1.0, -1.0], [-1.0, -1.0, 2.0]]


def test_equal_rewards_and_single_sample_groups_get_zero() -> None:
    groups = make_groups([0.7, 0.7, 0.7], [5.0])
    compute_advantages(groups, estimator="grpo", normalize_std=True)
    assert advantages(groups) == [[0.0, 0.0, 0.0], [0.0]]


def whitened(values: list[float], weights: list[int]) -> list[float]:
    """slime's distributed_masked_whiten written out: token-weighted mean and Bessel-corrected variance."""
    count = sum(weights)
    mean = sum(w * v for w, v in zip(weights, values, strict=True)) / count
    variance = (sum(w * v * v for w, v in zip(weights, values, strict=True)) / count - mean**2) * count / (count - 1)
    return [(v - mean) / math.sqrt(variance + 1e-8) for v in values]


def test_reinforce_plus_plus_baseline_is_group_centred_then_whitened_over_tokens() -> None:
    groups = make_groups([1.0, 0.0], [4.0, 0.0, 2.0])
    compute_advantages(groups, estimator="reinforce_plus_plus_baseline")
    centred = [0.5, -0.5, 2.0, -2.0, 0.0]
    assert [value for group in advantages(groups) for value in group] == pytest.approx(centred)
    # --normalize-advantages: a sample's value counts once per loss token (lengths 1, 3, 2, 1, 1 here).
    groups = make_groups([1.0, 0.0], [4.0, 0.0, 2.0])
    lengths = [1, 3, 2, 1, 1]
    for sample, length in zip([s for g in groups for s in g], lengths, strict=True):
        sample.tokens, sample.response_length = [1] * (length + 1), length
        sample.loss_mask, sample.rollout_log_probs = [1] * length, [0.0] * length
    compute_advantages(groups, estimator="reinforce_plus_plus_baseline", normalize_advantages=True)
    flat = [value for group in advantages(groups) for value in group]
    assert flat == pytest.approx(whitened(centred, lengths))
    tokens = [v for v, n in zip(flat, lengths, strict=True) for _ in range(n)]
    assert statistics.mean(tokens) == pytest.approx(0.0, abs=1e-9)
    assert statistics.stdev(tokens) == pytest.approx(1.0, rel=1e-6)


def test_reinforce_plus_plus_whitens_the_raw_rewards() -> None:
    groups = make_groups([1.0, 0.0], [4.0])
    compute_advantages(groups, estimator="reinforce_plus_plus", normalize_advantages=True)
    assert [value for group in advantages(groups) for value in group] == pytest.approx(
        whitened([1.0, 0.0, 4.0], [1, 1, 1]))


def test_gspo_advantages_are_grpos() -> None:
    grpo, gspo = make_groups([1.0, 0.0, 0.5]), make_groups([1.0, 0.0, 0.5])
    compute_advantages(grpo, estimator="grpo")
    compute_advantages(gspo, estimator="gspo")
    assert advantages(grpo) == advantages(gspo)


def test_aborted_samples_get_zero_and_are_not_counted() -> None:
    groups = make_groups([1.0, 0.0, 99.0])
    groups[0][2].status = SampleStatus.ABORTED
    groups[0][2].advantage = 3.0
    compute_advantages(groups, estimator="grpo", normalize_std=False)
    assert advantages(groups) == [[0.5, -0.5, 0.0]]

    groups = make_groups([1.0, None], [0.0, 2.0])
    groups[0][1].status = SampleStatus.ABORTED  # an aborted sample may carry no reward at all
    compute_advantages(groups, estimator="reinforce_plus_plus_baseline", normalize_advantages=True)
    assert groups[0][1].advantage == 0.0
    assert groups[0][0].advantage == 0.0  # alone in its group after exclusion
    # The whitened set holds the lone sample (0) and ±1, one token each: variance (2/3)·(3/2) = 1.
    assert [groups[1][0].advantage, groups[1][1].advantage] == pytest.approx(
        [-1 / math.sqrt(1 + 1e-8), 1 / math.sqrt(1 + 1e-8)]
    )


def test_dict_rewards_use_reward_key() -> None:
    groups = make_groups([{"acc": 1.0, "len": 9.0}, {"acc": 0.0, "len": 1.0}])
    compute_advantages(groups, estimator="grpo", normalize_std=False, reward_key="acc")
    assert advantages(groups) == [[0.5, -0.5]]


def test_errors() -> None:
    with pytest.raises(AdvantageError, match=r"--advantage-estimator 'cispo' is not supported; known: grpo"):
        compute_advantages(make_groups([1.0]), estimator="cispo")
    with pytest.raises(AdvantageError, match=r"ppo: its advantages are computed on the ranks"):
        compute_advantages(make_groups([1.0]), estimator="ppo")


def test_token_level_estimators_hand_the_ranks_each_samples_reward() -> None:
    # ppo, and reinforce_plus_plus with --gamma < 1: the ranks compute and whiten per-token advantages
    groups = make_groups([1.0, 0.5, 0.25])
    groups[0][1].status = SampleStatus.ABORTED  # an aborted straggler still trains on nothing
    compute_advantages(groups, estimator="ppo", normalize_advantages=True, token_level=True)
    assert [s.advantage for s in groups[0]] == [1.0, 0.0, 0.25]
    with pytest.raises(AdvantageError, match=r"sample 0/1 has no reward; score the group first"):
        compute_advantages(make_groups([1.0, None]), estimator="grpo")


# ----------------------------------------------------------------------------------------------- filters


@pytest.fixture
def hook_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for name in [name for name in sys.modules if name.startswith("filter_hooks")]:
        del sys.modules[name]


def test_reward_std_positive() -> None:
    assert reward_std_positive(make_groups([1.0, 0.0, 1.0])[0]) == FilterResult(keep=True)
    assert reward_std_positive(make_groups([0.5, 0.5, 0.5])[0]) == FilterResult(keep=False, reason="zero_std")
    group = make_groups([1.0, 1.0, 0.0])[0]
    group[2].status = SampleStatus.ABORTED  # the only differing reward was aborted: nothing to learn
    assert reward_std_positive(group).reason == "zero_std"
    dict_group = make_groups([{"acc": 1.0, "x": 0.0}, {"acc": 1.0, "x": 1.0}])[0]
    assert reward_std_positive(dict_group, reward_key="acc").keep is False
    assert reward_std_positive(dict_group, reward_key="x").keep is True


async def test_builtin_filter_loaded_by_path_counts_drops() -> None:
    dynamic = DynamicFilter.load("coordinator.rollout.filters:reward_std_positive", reward_key="acc")
    kept = make_groups([{"acc": 1.0}, {"acc": 0.0}])[0]
    flat = make_groups([{"acc": 1.0}, {"acc": 1.0}])[0]
    assert (await dynamic(kept)).keep is True
    assert await dynamic(flat) == FilterResult(keep=False, reason="zero_std")
    assert await dynamic(flat) == FilterResult(keep=False, reason="zero_std")
    assert dynamic.metrics() == {"rollout/filter_drop/zero_std": 2.0, "rollout/filter_kept": 1.0}
    dynamic.reset()
    assert dynamic.metrics() == {"rollout/filter_kept": 0.0}


async def test_custom_filters_sync_async_and_bool(hook_dir: Path) -> None:
    (hook_dir / "filter_hooks.py").write_text(
        textwrap.dedent(
            """
            from coordinator.rollout.filters import FilterResult

            def long_enough(group):
                return FilterResult(keep=len(group) >= 2, reason=None if len(group) >= 2 else "too_small")

            async def async_all_positive(group):
                return FilterResult(keep=all(s.scalar_reward() > 0 for s in group), reason="non_positive")

            def as_bool(group):
                return len(group) >= 2

            def wrong(group):
                return "yes"
            """
        ),
        encoding="utf-8",
    )
    small, pair = make_groups([1.0])[0], make_groups([1.0, -1.0])[0]
    long_enough = DynamicFilter.load("filter_hooks:long_enough")
    assert await long_enough(small) == FilterResult(keep=False, reason="too_small")
    assert await long_enough(pair) == FilterResult(keep=True)
    positive = DynamicFilter.load("filter_hooks.async_all_positive")
    assert await positive(pair) == FilterResult(keep=False, reason="non_positive")
    assert await positive(small) == FilterResult(keep=True)  # a reason on a kept group is dropped
    as_bool = DynamicFilter.load("filter_hooks:as_bool")
    assert await as_bool(small) == FilterResult(keep=False, reason="filtered")
    with pytest.raises(
        FilterError, match=r"--dynamic-sampling-filter-path 'filter_hooks:wrong' returned str"
    ):
        await DynamicFilter.load("filter_hooks:wrong")(pair)
    with pytest.raises(HookLoadError, match=r"--dynamic-sampling-filter-path 'filter_hooks:missing'"):
        DynamicFilter.load("filter_hooks:missing")
