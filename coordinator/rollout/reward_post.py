"""slime's `--custom-reward-post-process-path` and `--log-reward-category`, on the coordinator.

Owns:
- `RewardPostProcess`: slime's hook `fn(args, samples) -> (raw_rewards, rewards)` called on the rollout's samples
  (flat, in group order) in place of the estimator's group normalisation: as in slime, the returned `rewards`
  are the advantages of grpo / gspo / reinforce_plus_plus_baseline / reinforce_plus_plus (each sample's value
  on each of its loss tokens), whitened afterwards with `--normalize-advantages`; `raw_rewards` are recorded in
  each sample's metadata (`raw_reward`) for logs and dumps.
- `reward_category_metrics`: slime's `error_cat/<category>`, the share of samples whose reward dict holds each
  value under the `--log-reward-category` key.

Invariants: the hook's output is checked (two sequences of one finite number per sample) before any sample is
changed; a failure is a `RewardPostProcessError` naming the flag and the hook.
"""

from __future__ import annotations

import argparse
import math
from collections import Counter
from collections.abc import Callable, Sequence

from coordinator.rollout.advantages import whiten_over_tokens
from replay.sample import Sample, SampleStatus
from workers.errors import RaylessError

FLAG = "--custom-reward-post-process-path"


class RewardPostProcessError(RaylessError, ValueError):
    """The reward post-process hook returned something slime's contract does not allow."""


def _numbers(values: object, what: str, count: int, path: str) -> list[float]:
    if not isinstance(values, Sequence) or isinstance(values, str | bytes) or len(values) != count:
        size = len(values) if isinstance(values, Sequence) else type(values).__name__
        raise RewardPostProcessError(f"{FLAG} {path}: {what} must be a list of one number per sample ({count}), "
                                     f"got {size}")
    numbers = []
    for value in values:
        number = float(value) if isinstance(value, int | float) and not isinstance(value, bool) else math.nan
        if not math.isfinite(number):
            raise RewardPostProcessError(f"{FLAG} {path}: {what} holds {value!r}, not a finite number")
        numbers.append(number)
    return numbers


class RewardPostProcess:
    def __init__(self, fn: Callable[..., object], path: str, args: argparse.Namespace) -> None:
        self.fn, self.path, self.args = fn, path, args

    @classmethod
    def load(cls, path: str, *, args: argparse.Namespace) -> RewardPostProcess:
        from workers.hook_loading import load_object

        return cls(load_object(path, what=FLAG), path, args)

    def apply(self, groups: Sequence[Sequence[Sample]], *, normalize_advantages: bool) -> None:
        """Set every sample's advantage from the hook's `rewards` (see the module docstring)."""
        samples = [sample for group in groups for sample in group]
        result = self.fn(self.args, samples)
        if not isinstance(result, tuple | list) or len(result) != 2:
            raise RewardPostProcessError(f"{FLAG} {self.path}: must return (raw_rewards, rewards), got "
                                         f"{type(result).__name__}")
        raw = _numbers(result[0], "raw_rewards", len(samples), self.path)
        rewards = _numbers(result[1], "rewards", len(samples), self.path)
        for sample, raw_reward, reward in zip(samples, raw, rewards, strict=True):
            sample.metadata["raw_reward"] = raw_reward
            sample.advantage = 0.0 if sample.status is SampleStatus.ABORTED else reward
        if normalize_advantages:
            whiten_over_tokens([sample for sample in samples if sample.status is not SampleStatus.ABORTED])


def reward_category_metrics(samples: Sequence[Sample], key: str) -> dict[str, float]:
    """slime's `error_cat/<value>`: the share of samples whose reward dict has each value under `key` (samples
    whose reward is not a dict holding `key` count under `error_cat/None`, as a missing category)."""
    if not samples:
        return {}
    counts = Counter(str(sample.reward.get(key)) if isinstance(sample.reward, dict) else "None"
                     for sample in samples)
    return {f"error_cat/{category}": count / len(samples) for category, count in sorted(counts.items())}
