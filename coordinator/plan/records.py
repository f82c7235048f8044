"""The placement plan's frozen records: every process a node launches (its slot), and the plan as a whole.

Owns `PlacementPlan`, `NodePlan`, the slots (`RanksSlot`, `EngineSlot`, `RouterSlot`) every launcher takes its
command line, port and environment from, and the weight-sync and memory-swap plans. Invariant: a record is
never changed after `build_plan` made it; the run launches what it says and `--dry-run` prints the same.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from coordinator.engines.spec import EngineLaunchSpec, router_command
from coordinator.plan.backend import EngineChoice
from coordinator.plan.demands import GpuDemand
from coordinator.plan.gpus import GpuInventory
from coordinator.plan.layout import NodeLayout, join_host_port
from coordinator.plan.snapshots import SnapshotPlace
from coordinator.train.group import rank_environment
from coordinator.train.torchrun import TorchrunSpec, torchrun_log_dir


@dataclass(frozen=True)
class EngineSlot:
    """One launched engine: its GPUs and the spec (command, port, environment) it is launched from."""

    name: str
    group: str
    gpus: tuple[int, ...]
    choice: EngineChoice
    spec: EngineLaunchSpec
    log: Path

    @property
    def port(self) -> int:
        assert self.spec.port is not None
        return self.spec.port

    def command(self) -> list[str]:
        return self.spec.command(self.port)


@dataclass(frozen=True)
class RanksSlot:
    """The torchrun child and the ranks it starts on this node (LOCAL_RANK i on the i-th of `gpus`)."""

    gpus: tuple[int, ...]
    device: str  # "cuda" (NCCL) or "cpu" (gloo)
    spec: TorchrunSpec
    #: set on top of the coordinator's environment (CUDA_VISIBLE_DEVICES); the control variables come on top
    env: tuple[tuple[str, str], ...]
    control_host: str
    control_port: int
    #: --control-port was given: never replaced by another port at launch
    control_port_fixed: bool
    log: Path
    name: str = "train-ranks"
    #: what the ranks dial, when not `control_host` (multi-node: node 0's address, the layout's)
    dial_host: str | None = None

    @property
    def control_address(self) -> str:
        """Where the ranks dial the control channel (`RAYLESS_CONTROL_ADDR`)."""
        return join_host_port(self.dial_host or self.control_host, self.control_port)

    def command(self) -> list[str]:
        return self.spec.command(log_dir=torchrun_log_dir(self.log))

    def environment(self, token: str = "***") -> dict[str, str]:
        """Everything the plan sets in the torchrun child's environment (the token masked unless given)."""
        return {**dict(self.env), **rank_environment(self.control_address, token)}


@dataclass(frozen=True)
class RouterSlot:
    host: str
    port: int
    prometheus_port: int
    policy: str
    log: Path
    python: str = field(default=sys.executable)
    name: str = "router-rollout"
    gpus: tuple[int, ...] = ()  # the router runs on the CPU
    extra_args: tuple[str, ...] = ()  # slime's --router-* flags, without the prefix

    def command(self) -> list[str]:
        return router_command(python=self.python, host=self.host, port=self.port,
                              prometheus_port=self.prometheus_port, policy=self.policy, extra_args=self.extra_args)


@dataclass(frozen=True)
class NodePlan:
    """What one node launches, and on which of its GPUs."""

    node_rank: int
    gpus: GpuInventory
    demands: tuple[GpuDemand, ...]
    ranks: RanksSlot | None
    rollout_engines: tuple[EngineSlot, ...]
    eval_engines: tuple[EngineSlot, ...]
    router: RouterSlot | None
    #: on-policy distillation's teacher engine, served from --opd-teacher-load (node 0; none otherwise)
    teacher_engines: tuple[EngineSlot, ...] = ()
    #: GPUs `--sglang-config`'s placeholder groups hold with no process on them (slime: reserved slots)
    reserved_gpus: tuple[int, ...] = ()

    @property
    def gpus_needed(self) -> int:
        used = [gpu for slot in self.processes() for gpu in slot.gpus] + list(self.reserved_gpus)
        return max(used) + 1 if used else 0

    def processes(self) -> Iterator[RanksSlot | EngineSlot | RouterSlot]:
        if self.ranks is not None:
            yield self.ranks
        yield from self.rollout_engines
        yield from self.eval_engines
        yield from self.teacher_engines
        if self.router is not None:
            yield self.router


@dataclass(frozen=True)
class WeightSyncPlan:
    mode: str  # --update-weight-transfer-mode
    bucket_bytes: int  # --update-weight-buffer-size
    detail: str
    #: where disk snapshots go (`coordinator.plan.snapshots`): a tmpfs directory in colocation, else the run dir
    snapshots: SnapshotPlace
    #: --update-weight-mode: "delta" only where every rollout engine is ours (others take full updates)
    update_mode: str = "full"


@dataclass(frozen=True)
class SwapPlan:
    """The memory hand-over of each step (`coordinator.weights.colocate`): who gives memory back while the other works."""

    offload_train: bool  # --offload-train: the ranks' state leaves the device between steps
    offload_rollout: bool  # --offload-rollout: the engines release weights and KV cache while the ranks train
    train_memory_margin_bytes: int


@dataclass(frozen=True)
class PlacementPlan:
    policy: str
    nodes: tuple[NodePlan, ...]
    #: this node's rank: the node the coordinator runs on
    node_rank: int
    rollout_choice: EngineChoice | None
    eval_choice: EngineChoice | None
    external_engines: tuple[str, ...]
    weight_sync: WeightSyncPlan | None
    warnings: tuple[str, ...] = ()
    #: the per-step memory hand-over; None when nothing is swapped
    swap: SwapPlan | None = None
    #: a --dry-run plan: built despite what this machine lacks (see warnings)
    lenient: bool = False
    #: a multi-node run's layout (how the nodes find node 0); None on a single node
    layout: NodeLayout | None = None
    #: (name, group, node) of every engine another node launches, as that node's plan names it
    remote_engines: tuple[tuple[str, str, int], ...] = ()
    #: (node, ranks, rollout engines, eval engines) of every node, for the printout
    shares: tuple[tuple[int, int, int, int], ...] = ()

    @property
    def local(self) -> NodePlan:
        return next(node for node in self.nodes if node.node_rank == self.node_rank)

    def remote_engine_nodes(self, group: str) -> tuple[tuple[str, int], ...]:
        """(name, node) of the engines of `group` that other nodes launch."""
        return tuple((name, node) for name, engine_group, node in self.remote_engines if engine_group == group)
