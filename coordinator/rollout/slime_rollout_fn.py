"""slime's rollout-function form: `generate_rollout(args, rollout_id, data_source, evaluation=False)`.

Owns the call of a slime-style `--rollout-function-path` (or `--eval-function-path`): the function gets the
hooks' `args`, the rollout id and `SlimeDataSource` (slime's `get_samples(n)` / `add_samples(groups)` over our
prompt source), and returns groups of samples (`list[list[Sample]]`, or an object with `samples` and
`metrics`: slime's `RolloutFnTrainOutput`); called with `evaluation=True` (`evaluate`, an evaluation on the
rollout engines) it returns slime's eval `data` (`{name: {"rewards", "truncated", "samples"}}`, or an object
with `data` and `metrics`), measured as miles' `log_eval_rollout_data` does (`eval_metrics`). An `async def` function is awaited on the event loop; a plain
function (slime's are: they drive their own event loop) runs in a worker thread, where `run(coro)` runs a
coroutine on the run's loop (slime's `slime.utils.async_utils.run`), so its `post` calls go through our client.

Invariants: every sample the function returns is settled into our invariant (`settle_hook_fields`) and
renumbered in order (`group_index`, `sample_index`, `index`); the data source hands each prompt out once per
epoch, groups given back with `add_samples` first.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from coordinator.hooks.calls import call_hook
from coordinator.hooks.runtime import HookError, hook_call
from replay.sample import RolloutBatch, Sample, SampleError, SampleStatus, settle_hook_fields

if TYPE_CHECKING:
    from coordinator.rollout.context import RolloutContext

T = TypeVar("T")


class SlimeDataSource:
    """slime's data source seen by a slime-style rollout function: groups of fresh samples of our prompts."""

    def __init__(self, context: RolloutContext) -> None:
        self._context = context
        self._returned: list[list[Sample]] = []
        self._next_group = 0

    def get_samples(self, num_samples: int) -> list[list[Sample]]:
        """`num_samples` groups, each `--n-samples-per-prompt` samples of one prompt (given-back groups first)."""
        n = self._context.config.rollout.n_samples_per_prompt
        groups = self._returned[:num_samples]
        self._returned = self._returned[num_samples:]
        for record in self._context.data_source.take(num_samples - len(groups)):
            group_index = self._next_group
            self._next_group += 1
            groups.append([Sample(group_index=group_index, sample_index=k, index=group_index * n + k,
                                  prompt=copy.deepcopy(record.prompt), label=copy.deepcopy(record.label),
                                  metadata={**copy.deepcopy(record.metadata), "prompt_index": record.index})
                           for k in range(n)])
        return groups

    def add_samples(self, samples: list[list[Sample]]) -> None:
        """Groups given back (e.g. aborted ones): handed out again first."""
        self._returned.extend(samples)

    def __len__(self) -> int:
        return len(self._context.data_source) + len(self._returned)


class SlimeRolloutFn:
    """A slime-style rollout function as rayless calls rollout functions: `await fn(rollout_id, version)`."""

    #: Its generate calls need an address to post to (the run serves one when no router is used).
    posts_to_engines = True

    def __init__(self, fn: Callable[..., object], *, path: str, context: RolloutContext, what: str) -> None:
        self.fn = fn
        self.path = path
        self.what = what
        self.context = context
        self._data_source: SlimeDataSource | None = None

    @property
    def data_source(self) -> SlimeDataSource:
        if self._data_source is None:
            self._data_source = SlimeDataSource(self.context)
        return self._data_source

    async def _call_fn(self, rollout_id: int, *, evaluation: bool) -> object:
        runtime = self.context.hook_runtime
        if runtime is None:
            raise HookError(f"{self.what} {self.path!r}: slime-style rollout functions need the run's hook "
                            "runtime")
        with hook_call(runtime):  # a sync function runs in a worker thread a stop signal does not wait for
            return await call_hook(self.fn, runtime.args, rollout_id, self.data_source, what=f"{self.what} "
                                   f"{self.path!r}", kind="rollout", evaluation=evaluation)

    async def __call__(self, rollout_id: int, weight_version: str) -> RolloutBatch:
        return self._batch(await self._call_fn(rollout_id, evaluation=False), rollout_id)

    async def evaluate(self, rollout_id: int, weight_version: str) -> EvalResult:
        """slime's eval call, `fn(args, rollout_id, data_source, evaluation=True)`: its `data` and metrics."""
        return eval_result(await self._call_fn(rollout_id, evaluation=True), where=f"{self.what} {self.path!r}")

    def _batch(self, result: object, rollout_id: int) -> RolloutBatch:
        groups = getattr(result, "samples", result)
        metrics = getattr(result, "metrics", None) or {}
        where = f"{self.what} {self.path!r}"
        if not isinstance(groups, list) or not all(isinstance(group, list) for group in groups):
            raise HookError(f"{where} returned {type(groups).__name__}; expected a list of sample groups "
                            "(list[list[Sample]]) or an object with `samples` (slime's RolloutFnTrainOutput)")
        index = 0
        for group_index, group in enumerate(groups):
            for sample_index, sample in enumerate(group):
                if not isinstance(sample, Sample):
                    raise HookError(f"{where} returned a {type(sample).__name__} in group {group_index}; "
                                    "expected coordinator.hooks.Sample")
                sample.group_index, sample.sample_index, sample.index = group_index, sample_index, index
                index += 1
                try:
                    settle_hook_fields(sample, where=where)
                except SampleError as error:
                    raise HookError(str(error)) from None
                if sample.reward is None and sample.status in (SampleStatus.ABORTED, SampleStatus.FAILED):
                    sample.reward = 0.0  # as the default rollout: not scored
                elif sample.reward is None:
                    raise HookError(f"{where}: sample {group_index}/{sample_index} has no reward; a slime-style "
                                    "rollout function scores its samples (slime's generate_and_rm)")
        return RolloutBatch(rollout_id=rollout_id, groups=groups,
                            metrics={str(k): float(v) for k, v in dict(metrics).items()})


@dataclass(frozen=True)
class EvalResult:
    """What a slime/miles eval function returned: per dataset name `{"rewards": [...], "truncated": [...],
    "samples": [...]}` (`data`) and extra metrics."""

    data: dict[str, dict[str, Any]]
    metrics: dict[str, Any]


def eval_result(result: object, *, where: str) -> EvalResult:
    """`RolloutFnEvalOutput(data, metrics)` or the bare `data` dict (slime's legacy return)."""
    data = getattr(result, "data", result)
    metrics = getattr(result, "metrics", None) or {}
    if not isinstance(data, dict) or not all(isinstance(value, dict) and "rewards" in value
                                             for value in data.values()):
        raise HookError(f"{where} returned {type(result).__name__} for an evaluation; expected "
                        "RolloutFnEvalOutput(data, metrics) with data = {name: {'rewards': [...], ...}}")
    return EvalResult(data={str(name): value for name, value in data.items()}, metrics=dict(metrics))


def eval_metrics(result: EvalResult) -> dict[str, float]:
    """miles' `log_eval_rollout_data`: per dataset `eval/<name>` (mean reward, None counted as 0),
    `eval/<name>-none_reward_ratio`, `eval/<name>-truncated_ratio` when given; then the function's metrics."""
    row: dict[str, float] = {}
    for name, entry in result.data.items():
        rewards = list(entry["rewards"])
        none = sum(reward is None for reward in rewards)
        values = [0.0 if reward is None else float(reward) for reward in rewards]
        row[f"eval/{name}-none_reward_ratio"] = none / len(values) if values else 0.0
        row[f"eval/{name}"] = sum(values) / len(values) if values else 0.0
        if entry.get("truncated"):
            truncated = list(entry["truncated"])
            row[f"eval/{name}-truncated_ratio"] = sum(map(bool, truncated)) / len(truncated)
        if entry.get("samples") is not None:
            row[f"eval/{name}/samples"] = float(len(entry["samples"]))
    for key, value in result.metrics.items():
        if isinstance(value, int | float):  # a metrics row holds numbers
            row[str(key)] = float(value)
    return row
