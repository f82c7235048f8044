"""Command routing on the rank: each control-channel command to the trainer's method, its reply record back.

Owns `handle`. Invariants: a command that reads or writes the training state runs with that state on the
device (onloaded first when it was offloaded, offloaded again after); every reply is the record the command
declares (`Command.reply`), so the coordinator reads fields of the one type it expects.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from workers import protocol
from workers.train_rank.trainer import Trainer

#: commands that read or write the training state: run with the state on the device
_NEEDS_STATE = (protocol.TrainCommand, protocol.SaveCommand, protocol.SaveHfCommand, protocol.LoadCommand,
                protocol.ExportWeightsCommand, protocol.WeightManifestCommand, protocol.BroadcastWeightsCommand,
               protocol.ForwardBackwardCommand, protocol.OptimStepCommand)


def handle(trainer: Trainer, command: protocol.Command) -> protocol.Reply:
    state = trainer.state
    if state is not None and state.offloaded and isinstance(command, _NEEDS_STATE):
        state.onload()  # e.g. a checkpoint save, or an export for an engine's recovery, between steps
        try:
            return _dispatch(trainer, command)
        finally:
            state.offload()
    return _dispatch(trainer, command)


def _handlers(trainer: Trainer) -> dict[type[protocol.Command], Callable[[Any], protocol.Reply]]:
    return {
        protocol.InitCommand: trainer.init,
        protocol.TrainCommand: trainer.train,
        protocol.SaveCommand: trainer.save,
        protocol.SaveHfCommand: trainer.save_hf,
        protocol.PublishCommand: trainer.publish,
        protocol.LoadCommand: trainer.load,
        protocol.ExportWeightsCommand: trainer.export_weights,
        protocol.WeightManifestCommand: trainer.weight_manifest,
        protocol.BroadcastWeightsCommand: trainer.broadcast_weights,
        protocol.DestroyWeightGroupCommand: trainer.destroy_weight_group,
        protocol.OffloadCommand: trainer.offload,
        protocol.OnloadCommand: trainer.onload,
        protocol.ForwardBackwardCommand: trainer.forward_backward,
        protocol.OptimStepCommand: trainer.optim_step,
    }


def _dispatch(trainer: Trainer, command: protocol.Command) -> protocol.Reply:
    handler = _handlers(trainer).get(type(command))
    if handler is None:
        raise protocol.ProtocolError(f"the rank has no handler for command {command.kind!r}")
    reply = handler(command)
    if not isinstance(reply, command.reply):  # our bug: caught here, named, rather than a decode error there
        raise TypeError(f"the {command.kind!r} handler answered {type(reply).__name__}, not {command.reply.__name__}")
    return reply
