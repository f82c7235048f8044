"""miles' class-based rollout function (`--rollout-function-path` / `--eval-function-path` naming a class whose
instances take one input record), constructed and called exactly as miles does.

Owns the call: `cls(RolloutFnConstructorInput(args, data_source))` once per path (the hooks' `args`, slime's
data source over our prompts), then `instance(RolloutFnTrainInput(rollout_id, weight_version))` for a rollout
and `instance(RolloutFnEvalInput(rollout_id, weight_version=...))` for an evaluation on the rollout engines
(miles' `call_rollout_function`); a `CheckpointEvalFn` gets `RolloutFnEvalInput(..., hf_dir=SNAPSHOT)` from the
eval dispatcher instead (`evaluate_snapshot`). An `async def __call__` is awaited on the run's loop; a plain one runs in a
worker thread (miles runs it in `asyncio.to_thread`), where `coordinator.hooks.run(coro)` reaches the loop.

Invariants: a rollout's result is `RolloutFnTrainOutput(samples, metrics)` or, as miles' compatibility shim
allows, the bare groups; an evaluation's is `RolloutFnEvalOutput(data, metrics)` or the bare `data` dict;
anything else is a HookError naming the path. Samples are settled and renumbered as a slime-style function's
(`SlimeRolloutFn._batch`).
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING

import anyio.to_thread

from coordinator.hooks.rollout_types import (
    RolloutFnConstructorInput,
    RolloutFnEvalInput,
    RolloutFnEvalOutput,
    RolloutFnTrainInput,
    RolloutFnTrainOutput,
)
from coordinator.hooks.runtime import HookError, hook_call
from coordinator.rollout.slime_rollout_fn import EvalResult, SlimeRolloutFn, eval_result

if TYPE_CHECKING:
    from coordinator.rollout.context import RolloutContext
    from replay.sample import RolloutBatch


def _miles_version(weight_version: str) -> int | str:
    """miles passes the engines' weight version as an int."""
    return int(weight_version) if weight_version.isdigit() else weight_version


class MilesRolloutFn(SlimeRolloutFn):
    """A miles rollout class as rayless calls rollout functions: `await fn(rollout_id, version)`, and
    `await fn.evaluate(rollout_id, version)` for an evaluation."""

    def __init__(self, cls: type, *, path: str, context: RolloutContext, what: str) -> None:
        super().__init__(cls, path=path, context=context, what=what)
        runtime = context.hook_runtime
        if runtime is None:
            raise HookError(f"{what} {path!r}: miles' rollout classes need the run's hook runtime")
        self.instance = cls(RolloutFnConstructorInput(args=runtime.args, data_source=self.data_source))
        if not callable(self.instance):
            raise HookError(f"{what} {path!r}: instances of {cls.__name__} are not callable")

    async def _call(self, record: RolloutFnTrainInput | RolloutFnEvalInput) -> object:
        runtime = self.context.hook_runtime
        assert runtime is not None  # checked at construction
        with hook_call(runtime):
            if inspect.iscoroutinefunction(type(self.instance).__call__):
                return await self.instance(record)
            result = await anyio.to_thread.run_sync(self.instance, record)
            if inspect.isawaitable(result):
                result = await result
            return result

    async def __call__(self, rollout_id: int, weight_version: str) -> RolloutBatch:
        result = await self._call(RolloutFnTrainInput(rollout_id=rollout_id,
                                                      weight_version=_miles_version(weight_version)))
        if isinstance(result, RolloutFnEvalOutput):
            raise HookError(f"{self.what} {self.path!r} returned a RolloutFnEvalOutput for a training rollout; "
                            "expected RolloutFnTrainOutput(samples, metrics)")
        if not isinstance(result, RolloutFnTrainOutput | list):
            raise HookError(f"{self.what} {self.path!r} returned {type(result).__name__}; expected "
                            "RolloutFnTrainOutput(samples, metrics)")
        return self._batch(result, rollout_id)

    async def evaluate(self, rollout_id: int, weight_version: str) -> EvalResult:
        result = await self._call(RolloutFnEvalInput(rollout_id=rollout_id, weight_version=str(weight_version)))
        return eval_result(result, where=f"{self.what} {self.path!r}")

    @property
    def evaluates_snapshots(self) -> bool:
        """miles' `CheckpointEvalFn`: it evaluates a snapshot directory (`evaluate_snapshot`), not the engines."""
        return callable(getattr(self.instance, "evaluate_checkpoint", None))

    async def evaluate_snapshot(self, rollout_id: int, weight_version: str, hf_dir: str) -> EvalResult:
        """miles' `_eval_checkpoint` call: `RolloutFnEvalInput(rollout_id, weight_version, hf_dir)`."""
        result = await self._call(RolloutFnEvalInput(rollout_id=rollout_id, weight_version=str(weight_version),
                                                     hf_dir=hf_dir))
        return eval_result(result, where=f"{self.what} {self.path!r}")

    def dispose(self) -> None:
        """miles' `RolloutManager.dispose()`: the instance's `dispose`, when it has one."""
        dispose = getattr(self.instance, "dispose", None)
        if callable(dispose):
            dispose()
