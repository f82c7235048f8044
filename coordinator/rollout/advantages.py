"""Advantage estimators, computed on the coordinator from the rewards of each prompt group.

Owns `sample.advantage`: `compute_advantages` for slime's critic-free estimators (`grpo`, `gspo`,
`reinforce_plus_plus`, `reinforce_plus_plus_baseline`, with `normalize_std` and the token-level whitening of
`normalize_advantages`). With `token_level` (`ppo`, and `reinforce_plus_plus` with `--gamma` < 1) each sample's
advantage is its scalar reward, unwhitened: the ranks turn it into per-token GAE advantages or discounted returns
and whiten those (`workers.train_rank.returns`). The names (and slime's we refuse, with the reason) are the config's: `coordinator.config.rollout`. The formulas:
docs/rollout.md.

Invariants kept by `compute_advantages`:
- every sample of every group gets a finite advantage (a group whose rewards are all equal gets 0.0);
- aborted samples get advantage 0.0 and take no part in any statistic (unlike slime), so one aborted straggler
  cannot shift its group's baseline.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from coordinator.config.rollout import ESTIMATORS
from replay.sample import Sample, SampleStatus
from workers.errors import RaylessError

EPSILON = 1e-6
WHITEN_EPSILON = 1e-8


class AdvantageError(RaylessError, ValueError):
    """An unknown estimator or rewards that cannot be turned into advantages."""


def _mean(values: Sequence[float]) -> float:
    return math.fsum(values) / len(values)


def _sample_std(values: Sequence[float], mean: float) -> float:
    if len(values) < 2:
        return 0.0
    return math.sqrt(math.fsum((value - mean) ** 2 for value in values) / (len(values) - 1))


def _centered(groups: Sequence[Sequence[Sample]], reward_key: str | None, *, normalize_std: bool) -> None:
    for group in groups:
        counted = [sample for sample in group if sample.status is not SampleStatus.ABORTED]
        for sample in group:
            sample.advantage = 0.0
        if not counted:
            continue
        rewards = [sample.scalar_reward(reward_key) for sample in counted]
        if min(rewards) == max(rewards):
            # Exactly zero: the float mean of equal values can differ from them by an ulp, and dividing
            # that by a 1e-6 std would turn rounding noise into a signal.
            continue
        mean = _mean(rewards)
        scale = _sample_std(rewards, mean) + EPSILON if normalize_std else 1.0
        for sample, reward in zip(counted, rewards, strict=True):
            sample.advantage = (reward - mean) / scale


def whiten_over_tokens(samples: Sequence[Sample]) -> None:
    """`(a - mean) / sqrt(var + 1e-8)` with token-weighted statistics (each sample's advantage counts once per
    loss token), as slime's `--normalize-advantages`. Samples without loss tokens keep their value."""
    weights = [sum(sample.loss_mask) for sample in samples]
    count = sum(weights)
    if count == 0:
        return
    mean = math.fsum(w * s.advantage for w, s in zip(weights, samples, strict=True)) / count
    mean_square = math.fsum(w * s.advantage**2 for w, s in zip(weights, samples, strict=True)) / count
    variance = max(mean_square - mean**2, 0.0)
    if count >= 2:
        variance *= count / (count - 1)
    scale = 1.0 / math.sqrt(variance + WHITEN_EPSILON)
    for sample in samples:
        sample.advantage = (sample.advantage - mean) * scale


def compute_advantages(
    groups: Sequence[Sequence[Sample]],
    *,
    estimator: str,
    normalize_std: bool = True,
    reward_key: str | None = None,
    normalize_advantages: bool = False,
    token_level: bool = False,
) -> None:
    """Set `advantage` on every sample of `groups` (see the module docstring for the estimators)."""
    if estimator not in ESTIMATORS:
        raise AdvantageError(
            f"--advantage-estimator {estimator!r} is not supported; known: {', '.join(ESTIMATORS)}"
        )
    for group in groups:
        for sample in group:
            if sample.status is not SampleStatus.ABORTED and sample.reward is None:
                raise AdvantageError(
                    f"sample {sample.group_index}/{sample.sample_index} has no reward; score the group first"
                )
    if token_level:
        for group in groups:
            for sample in group:
                aborted = sample.status is SampleStatus.ABORTED
                sample.advantage = 0.0 if aborted else sample.scalar_reward(reward_key)
        return
    if estimator == "ppo":
        raise AdvantageError("--advantage-estimator ppo: its advantages are computed on the ranks (token_level)")
    if estimator in ("grpo", "gspo"):
        _centered(groups, reward_key, normalize_std=normalize_std)
    elif estimator == "reinforce_plus_plus_baseline":
        _centered(groups, reward_key, normalize_std=False)
    else:  # reinforce_plus_plus
        for group in groups:
            for sample in group:
                aborted = sample.status is SampleStatus.ABORTED
                sample.advantage = 0.0 if aborted else sample.scalar_reward(reward_key)
    if normalize_advantages:
        whiten_over_tokens([sample for group in groups for sample in group
                            if sample.status is not SampleStatus.ABORTED])
