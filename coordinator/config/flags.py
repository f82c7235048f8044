"""The list of slices (`SLICES`, in `--help` order) and the flat index of every flag (`FLAGS`). Invariant: flag
names are unique across slices, so a flat slime/miles name finds its slice."""

from __future__ import annotations

from coordinator.config.checkpoint import CheckpointConfig
from coordinator.config.cluster import ClusterConfig
from coordinator.config.critic import CriticConfig
from coordinator.config.debug import DebugConfig
from coordinator.config.determinism import DeterminismConfig
from coordinator.config.distill import DistillConfig
from coordinator.config.evaluation import EvalConfig
from coordinator.config.fault_tolerance import FaultToleranceConfig
from coordinator.config.fields import FlagSpec, Slice
from coordinator.config.hooks import HooksConfig
from coordinator.config.logs import LoggingConfig
from coordinator.config.lora import LoraConfig
from coordinator.config.megatron import MegatronConfig
from coordinator.config.rollout import RolloutConfig
from coordinator.config.sft import SftConfig
from coordinator.config.sglang import SglangConfig
from coordinator.config.training import TrainConfig

#: (attribute on Config, slice class), in `--help` order.
SLICES: tuple[tuple[str, type[Slice]], ...] = (
    ("cluster", ClusterConfig),
    ("rollout", RolloutConfig),
    ("hooks", HooksConfig),
    ("sglang", SglangConfig),
    ("eval", EvalConfig),
    ("fault_tolerance", FaultToleranceConfig),
    ("debug", DebugConfig),
    ("train", TrainConfig),
    ("critic", CriticConfig),
    ("sft", SftConfig),
    ("lora", LoraConfig),
    ("distill", DistillConfig),
    ("checkpoint", CheckpointConfig),
    ("logging", LoggingConfig),
    ("megatron", MegatronConfig),
    ("determinism", DeterminismConfig),
)


def _index() -> dict[str, tuple[str, FlagSpec]]:
    index: dict[str, tuple[str, FlagSpec]] = {}
    for attribute, cls in SLICES:
        for spec in cls.specs():
            if spec.name in index:
                raise AssertionError(f"flag {spec.flag} declared in two slices")
            index[spec.name] = (attribute, spec)
    return index


#: field name → (Config attribute of its slice, its FlagSpec), for every flag.
FLAGS: dict[str, tuple[str, FlagSpec]] = _index()
