"""Advantage estimators, computed on the coordinator from the rewards of each prompt group.

Owns `sample.advantage`. Invariants kept by `compute_advantages`:
- every sample of every group gets a finite advantage (a group whose rewards are all equal gets 0.0);
- aborted samples get advantage 0.0 and take no part in any statistic: their response was cut off at an
  arbitrary point, so their reward says nothing about the policy. (slime keeps them in the statistics; we
  do not, so that one aborted straggler cannot shift its group's baseline.) With 0.0 they add no policy
  gradient; the training loop may still drop them.

Estimators (`--advantage-estimator`):
- `grpo`: `r - mean(group)`, divided by `std(group) + 1e-6` when `normalize_std` (the default; slime's
  `--disable-grpo-std-normalization` turns it off). The std is the sample (Bessel-corrected) std, as slime's
  `torch.std`; a group of one has std 0.
- `reinforce_plus_plus_baseline`: `r - mean(group)`, then whitened over the whole batch:
  `(a - mean(batch)) / (std(batch) + 1e-6)`. The batch normalisation *is* this estimator (REINFORCE++), so
  `normalize_std` does not apply. slime whitens over tokens; we whiten per sample (one value per response).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from replay.sample import Sample, SampleStatus
from workers.errors import RaylessError

EPSILON = 1e-6
ESTIMATORS = ("grpo", "reinforce_plus_plus_baseline")


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


def compute_advantages(
    groups: Sequence[Sequence[Sample]],
    *,
    estimator: str,
    normalize_std: bool = True,
    reward_key: str | None = None,
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
    if estimator == "grpo":
        _centered(groups, reward_key, normalize_std=normalize_std)
        return
    # reinforce_plus_plus_baseline: group baseline, then one normalisation over the whole batch.
    _centered(groups, reward_key, normalize_std=False)
    counted = [sample for group in groups for sample in group if sample.status is not SampleStatus.ABORTED]
    if not counted:
        return
    values = [sample.advantage for sample in counted]
    mean = _mean(values)
    scale = _sample_std(values, mean) + EPSILON
    for sample, value in zip(counted, values, strict=True):
        sample.advantage = (value - mean) / scale
