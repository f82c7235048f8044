"""Trainer settings for tests, written flat: `flat_settings({"model_path": ..., "lr": 1e-3})`.

Tests name a handful of settings; this maps each name to its component (`workers.protocol.train_settings`), so
a test reads as before while the rank receives the typed settings production builds. A name no component has
is a TypeError, as a typo should be.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec

from workers.protocol import InitCommand
from workers.protocol.train_settings import (
    BatchingSettings,
    CheckpointSettings,
    DeterminismSettings,
    LoraSettings,
    LossSettings,
    MemorySettings,
    ModelSettings,
    OptimizerSettings,
    ParallelSettings,
    TrainSettings,
)

COMPONENTS: dict[str, type[msgspec.Struct]] = {
    "model": ModelSettings, "optimizer": OptimizerSettings, "loss": LossSettings, "batching": BatchingSettings,
    "checkpoint": CheckpointSettings, "memory": MemorySettings, "parallel": ParallelSettings,
    "determinism": DeterminismSettings,
}
RENAMED = {"model_path": ("model", "path")}
COMPONENT_OF = {**{field: (component, field) for component, cls in COMPONENTS.items()
                   for field in cls.__struct_fields__}, **RENAMED}


def flat_settings(values: Mapping[str, Any] | TrainSettings) -> TrainSettings:
    if isinstance(values, TrainSettings):
        return values
    parts: dict[str, dict[str, Any]] = {component: {} for component in COMPONENTS}
    seed = 1234
    for name, value in values.items():
        if name == "seed":
            seed = value
            continue
        if name not in COMPONENT_OF:
            raise TypeError(f"no trainer setting is called {name!r}")
        component, field = COMPONENT_OF[name]
        if name == "lora" and isinstance(value, Mapping):
            value = LoraSettings(**{k: tuple(v) if isinstance(v, list) else v for k, v in value.items()})
        parts[component][field] = value
    built = {component: COMPONENTS[component](**fields) for component, fields in parts.items()
             if fields or component == "model"}
    return TrainSettings(**built, seed=seed)


def init_command(values: Mapping[str, Any] | TrainSettings) -> InitCommand:
    return InitCommand(flat_settings(values))


def flat_view(settings: TrainSettings) -> dict[str, Any]:
    """The settings as one flat dict of plain data, under the names `flat_settings` takes (the inverse)."""
    flat: dict[str, Any] = {"seed": settings.seed}
    for component in COMPONENTS:
        for field, value in msgspec.json.decode(msgspec.json.encode(getattr(settings, component))).items():
            flat["model_path" if (component, field) == ("model", "path") else field] = value
    return flat
