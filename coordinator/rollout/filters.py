"""Dynamic-sampling filters: decide whether a scored prompt group is kept for training.

Owns the filter protocol and its loading. A filter is `fn(group: list[Sample]) -> FilterResult`, or slime's
`fn(args, samples, **kwargs)` (`coordinator.hooks.forms.read_filter`), sync or async, loaded from
`--dynamic-sampling-filter-path`; it returns a `FilterResult`, a plain `bool` (`False` is dropped with reason
"filtered"), or any object with `keep` and `reason` (slime's `DynamicFilterOutput`; its
`keep_when_insufficient` is not used: rayless over-samples until enough groups are kept). A filter of our form
whose signature has a `reward_key` parameter gets `--reward-key` passed as a keyword. Invariant: `DynamicFilter.__call__` always returns a `FilterResult` whose `reason` is
a non-empty string exactly when `keep` is false, so drop reasons can be counted as metrics; anything else
a filter returns is an error naming the flag.

Built-in: `coordinator.rollout.filters:reward_std_positive` drops groups whose (non-aborted) rewards are all
equal, with reason "zero_std": such a group has zero advantage everywhere and teaches nothing.
"""

from __future__ import annotations

import argparse
import inspect
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from coordinator.hooks.calls import call_hook
from coordinator.hooks.forms import HookForm, HookSignatureError, read_filter
from replay.sample import Sample, SampleStatus
from workers.errors import RaylessError
from workers.hook_loading import load_object

FILTER_FLAG = "--dynamic-sampling-filter-path"


class FilterError(RaylessError, ValueError):
    """A filter that broke its contract."""


@dataclass(frozen=True)
class FilterResult:
    keep: bool
    reason: str | None = None


def reward_std_positive(group: list[Sample], *, reward_key: str | None = None) -> FilterResult:
    """Keep a group only when its non-aborted samples do not all have the same reward."""
    rewards = [
        sample.scalar_reward(reward_key) for sample in group if sample.status is not SampleStatus.ABORTED
    ]
    if len(set(rewards)) > 1:
        return FilterResult(keep=True)
    return FilterResult(keep=False, reason="zero_std")


def _accepts_reward_key(fn: Callable[..., object]) -> bool:
    try:
        parameters = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # builtins and some C callables have no signature
        return False
    return "reward_key" in parameters


class DynamicFilter:
    """A loaded filter with its contract checked; also counts drop reasons for the rollout metrics."""

    def __init__(self, fn: Callable[..., object], *, name: str, reward_key: str | None = None,
                 args: argparse.Namespace | None = None) -> None:
        if not callable(fn):
            raise FilterError(f"{FILTER_FLAG} {name!r} is not callable")
        try:
            self._slime_form = read_filter(FILTER_FLAG, name, fn).form is HookForm.SLIME
        except HookSignatureError as error:
            raise FilterError(str(error)) from None
        self._fn = fn
        self.name = name
        self._args = args
        self._kwargs: dict[str, Any] = (
            {"reward_key": reward_key} if _accepts_reward_key(fn) and not self._slime_form else {})
        self.drops: Counter[str] = Counter()
        self.kept = 0

    @classmethod
    def load(cls, path: str, *, reward_key: str | None = None, args: argparse.Namespace | None = None) -> DynamicFilter:
        """`args`: what a slime-style filter gets as its first argument (the hooks' args)."""
        return cls(load_object(path, what=FILTER_FLAG), name=path, reward_key=reward_key, args=args)

    async def __call__(self, group: list[Sample]) -> FilterResult:
        # a sync filter runs in a worker thread a stop signal does not wait for (coordinator.hooks.calls); its exit
        # or interrupt stops the run as a HookError naming it
        what = f"{FILTER_FLAG} {self.name!r}"
        args = (self._args, group) if self._slime_form else (group,)
        result = await call_hook(self._fn, *args, what=what, kind="filter", **({} if self._slime_form else self._kwargs))
        if isinstance(result, bool):
            result = FilterResult(keep=result, reason=None if result else "filtered")
        elif not isinstance(result, FilterResult) and isinstance(getattr(result, "keep", None), bool):
            result = FilterResult(keep=result.keep, reason=getattr(result, "reason", None))
        if not isinstance(result, FilterResult):
            raise FilterError(
                f"{FILTER_FLAG} {self.name!r} returned {type(result).__name__}; expected FilterResult(keep, reason)"
            )
        if not result.keep and not result.reason:
            result = FilterResult(keep=False, reason="filtered")
        if result.keep:
            self.kept += 1
            return FilterResult(keep=True)
        self.drops[str(result.reason)] += 1
        return result

    def metrics(self, prefix: str = "rollout/filter_drop/") -> dict[str, float]:
        """Drop counts by reason since the last `reset()`, plus the kept count."""
        return {
            **{f"{prefix}{reason}": float(count) for reason, count in sorted(self.drops.items())},
            "rollout/filter_kept": float(self.kept),
        }

    def reset(self) -> None:
        self.drops.clear()
        self.kept = 0
