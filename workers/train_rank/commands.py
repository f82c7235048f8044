"""Command routing on the rank: each control-channel command to the trainer's method, the reply as wire data.

Owns `handle`. Invariant: a command that reads or writes the training state runs with that state on the
device (onloaded first when it was offloaded, offloaded again after), and every reply leaves as plain data.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from workers import protocol
from workers.train_rank.trainer import Trainer

#: commands that read or write the training state: run with the state on the device
_NEEDS_STATE = (protocol.TrainCommand, protocol.SaveCommand, protocol.SaveHfCommand, protocol.LoadCommand,
                protocol.ExportWeightsCommand, protocol.WeightManifestCommand, protocol.BroadcastWeightsCommand)


def handle(trainer: Trainer, command: protocol.Command) -> dict[str, Any]:
    state = trainer.state
    if state is not None and state.offloaded and isinstance(command, _NEEDS_STATE):
        state.onload()  # e.g. a checkpoint save, or an export for an engine's recovery, between steps
        try:
            return _dispatch(trainer, command)
        finally:
            state.offload()
    return _dispatch(trainer, command)


def _handlers(trainer: Trainer) -> dict[type[protocol.Command], Callable[[Any], Any]]:
    return {
        protocol.InitCommand: trainer.init,
        protocol.TrainCommand: trainer.train,
        protocol.SaveCommand: trainer.save,
        protocol.SaveHfCommand: trainer.save_hf,
        protocol.LoadCommand: trainer.load,
        protocol.ExportWeightsCommand: trainer.export_weights,
        protocol.WeightManifestCommand: trainer.weight_manifest,
        protocol.BroadcastWeightsCommand: trainer.broadcast_weights,
        protocol.DestroyWeightGroupCommand: trainer.destroy_weight_group,
        protocol.OffloadCommand: trainer.offload,
        protocol.OnloadCommand: trainer.onload,
    }


def _dispatch(trainer: Trainer, command: protocol.Command) -> dict[str, Any]:
    handler = _handlers(trainer).get(type(command))
    if handler is None:
        raise protocol.ProtocolError(f"the rank has no handler for command {command.kind!r}")
    result = handler(command)
    return result.to_wire() if isinstance(result, protocol.Record) else result
