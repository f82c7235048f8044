"""miles' rollout-function records (`miles.rollout.base_types`), for class-based rollout functions ported by
their imports: `from coordinator.hooks import RolloutFnConstructorInput, RolloutFnTrainInput, ...`.

Owns the record types only; who constructs and calls such a class is `coordinator.rollout.miles_rollout_fn`.
Field names, defaults and the `evaluation` property are miles'. Invariant: importing this module imports
neither torch nor transformers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Union


@dataclass(frozen=True)
class RolloutFnConstructorInput:
    """What a class-based rollout function is constructed with: `cls(RolloutFnConstructorInput(args,
    data_source))`. `data_source` has slime's `get_samples(n)` / `add_samples(groups)`."""

    args: Any
    data_source: Any


@dataclass(frozen=True)
class RolloutFnBaseInput:
    rollout_id: int

    @property
    def evaluation(self) -> bool:
        raise NotImplementedError


@dataclass(frozen=True)
class RolloutFnTrainInput(RolloutFnBaseInput):
    #: the engines' weight version (miles: None before the first weight update)
    weight_version: int | str | None = None

    @property
    def evaluation(self) -> bool:
        return False


@dataclass(frozen=True)
class RolloutFnEvalInput(RolloutFnBaseInput):
    #: miles' eval-fleet GenerateState and snapshot directory (None on the rollout engines)
    generate_state: Any = None
    weight_version: str | None = None
    hf_dir: str | None = None

    @property
    def evaluation(self) -> bool:
        return True


@dataclass
class RolloutFnTrainOutput:
    """Groups of samples (`list[list[Sample]]`) and extra metrics (slime's and miles' record)."""

    samples: list[list[Any]]
    metrics: dict[str, Any] | None = None


@dataclass
class RolloutFnEvalOutput:
    """Per eval dataset name, `{"rewards": [...], "truncated": [...], "samples": [...]}`, and extra metrics."""

    data: dict[str, dict[str, Any]]
    metrics: dict[str, Any] | None = None


RolloutFnInput = Union[RolloutFnTrainInput, RolloutFnEvalInput]  # noqa: UP007 (a runtime alias, as miles')
RolloutFnOutput = Union[RolloutFnTrainOutput, RolloutFnEvalOutput]  # noqa: UP007
