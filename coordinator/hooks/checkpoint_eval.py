"""miles' `CheckpointEvalFn` (`miles.rollout.checkpoint_eval`): an `--eval-function-path` class that evaluates a
finished Hugging Face snapshot directory on a backend of its own, and `EvalSkip`, its way to skip a point.

Owns the base class and the test of whether a hook is one (`is_checkpoint_eval_fn`). Who exports the snapshot,
dispatches the evaluation beside training, logs it at the snapshot's step and retires the directory is the eval
dispatcher (`coordinator.eval.fleet.EvalFleet` with a checkpoint evaluator; docs/evaluation.md).

Invariants: as miles', `__init__` takes a `RolloutFnConstructorInput`, `evaluate_checkpoint(checkpoint_dir,
input)` returns a `RolloutFnEvalOutput`, and `__call__` serves evaluations only, with a snapshot; a class counts
as a checkpoint backend when it has `evaluate_checkpoint` (a subclass of this class, or of miles' own).
Importing this module imports neither torch nor transformers.
"""

from __future__ import annotations

import abc
import inspect
from typing import Any

from coordinator.hooks.rollout_types import RolloutFnEvalInput, RolloutFnEvalOutput, RolloutFnInput


class EvalSkip(Exception):
    """Raise from a `CheckpointEvalFn` to skip this eval point with a reason (logged as `eval/skipped_{reason}`)
    instead of counting as a crash."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class CheckpointEvalFn(abc.ABC):
    """Contract for eval backends that consume snapshot directories: `__init__(input: RolloutFnConstructorInput)`
    prepares the backend, `evaluate_checkpoint` runs one eval point against `checkpoint_dir`."""

    @abc.abstractmethod
    async def evaluate_checkpoint(self, checkpoint_dir: str, input: RolloutFnEvalInput) -> RolloutFnEvalOutput: ...

    async def __call__(self, input: RolloutFnInput) -> RolloutFnEvalOutput:
        if not input.evaluation:
            raise TypeError("CheckpointEvalFn only serves eval; keep the train fn on --rollout-function-path")
        hf_dir = getattr(input, "hf_dir", None)
        if hf_dir is None:
            raise TypeError("no snapshot was dispatched: a checkpoint eval fn needs a snapshot source "
                            "(--eval-hf-dir or --save-hf)")
        return await self.evaluate_checkpoint(hf_dir, input)

    def dispose(self) -> None:  # noqa: B027 (an optional hook, a no-op by default, as miles')
        """Tear down anything launched in `__init__`; called once when the run ends."""


def is_checkpoint_eval_fn(target: Any) -> bool:
    """Whether an `--eval-function-path` target is a snapshot backend: a class with `evaluate_checkpoint`."""
    return inspect.isclass(target) and callable(getattr(target, "evaluate_checkpoint", None))
