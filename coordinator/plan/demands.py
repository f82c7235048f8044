"""GPU demands and the policies that place them: what each kind of process asks for on a node, and where.

Owns `GpuDemand`, the placement policies (`POLICIES`: `separate`, `colocate`) and the message of a plan that
needs more GPUs than the node shows. Invariants: under `separate` no two units share a GPU; under `colocate`
only a rank and the rollout engine on its GPU do; demands are placed in slime's order (ranks, rollout, eval).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from coordinator.config.settings import Config
from coordinator.config.sglang_file import Deployment, deployment
from coordinator.plan.backend import EngineChoice
from coordinator.plan.gpus import GpuInventory


@dataclass(frozen=True)
class GpuDemand:
    """GPUs one kind of process asks for on a node: `units` processes (ranks or engines) of `per_unit` each."""

    group: str  # "train", "rollout", "eval"
    what: str  # "training ranks", "rollout engines", "eval engines"
    flags: str  # the flags that asked, as the user wrote them: "--rollout-num-gpus 4"
    units: int
    per_unit: int
    #: `--sglang-config`: each unit's (first GPU within the demand, GPUs), and the GPUs the demand holds with
    #: its placeholder groups' reserved ones (`span`); empty: `units` × `per_unit`, back to back
    shape: tuple[tuple[int, int], ...] = ()
    span: int = 0

    @property
    def total(self) -> int:
        return self.span if self.shape else self.units * self.per_unit

    @property
    def layout(self) -> tuple[tuple[int, int], ...]:
        """(first GPU within the demand, GPUs) of each unit."""
        return self.shape or tuple((unit * self.per_unit, self.per_unit) for unit in range(self.units))


#: A policy places demands: for each demand's group, the GPU positions of each of its units (and under
#: `RESERVED`, one unit of the GPUs placeholder groups hold without a process).
Policy = Callable[[Sequence[GpuDemand]], dict[str, tuple[tuple[int, ...], ...]]]
RESERVED = "reserved"


def _reserve(placed: dict[str, tuple[tuple[int, ...], ...]], demand: GpuDemand, start: int) -> None:
    """The GPUs of `demand`'s span no unit of it uses (placeholder groups), added under `RESERVED`."""
    used = {gpu for unit in placed[demand.group] for gpu in unit}
    free = tuple(gpu for gpu in range(start, start + demand.total) if gpu not in used)
    if free:
        placed[RESERVED] = (tuple(sorted({*(placed.get(RESERVED) or ((),))[0], *free})),)


def place_separately(demands: Sequence[GpuDemand]) -> dict[str, tuple[tuple[int, ...], ...]]:
    """Each demand on its own consecutive GPUs, in the order given: nothing shares a GPU."""
    placed: dict[str, tuple[tuple[int, ...], ...]] = {}
    position = 0
    for demand in demands:
        placed[demand.group] = tuple(tuple(range(position + offset, position + offset + size))
                                     for offset, size in demand.layout)
        _reserve(placed, demand, position)
        position += demand.total
    return placed


def place_colocated(demands: Sequence[GpuDemand]) -> dict[str, tuple[tuple[int, ...], ...]]:
    """Training ranks and rollout engines both from GPU 0 (the engines on the ranks' GPUs); eval engines after
    every GPU either uses."""
    placed: dict[str, tuple[tuple[int, ...], ...]] = {}
    position = 0
    for demand in demands:
        start = 0 if demand.group in ("train", "rollout") else position
        placed[demand.group] = tuple(tuple(range(start + offset, start + offset + size))
                                     for offset, size in demand.layout)
        _reserve(placed, demand, start)
        position = max(position, start + demand.total)
    return placed


POLICIES: dict[str, Policy] = {"separate": place_separately, "colocate": place_colocated}


def gpu_demands(config: Config, rollout: EngineChoice | None, eval_: EngineChoice | None, *,
                ranks_on_gpu: bool, rollout_engines: int | None = None, eval_engines: int | None = None
                ) -> list[GpuDemand]:
    """What the processes launched on one node ask for, in placement order (ranks, rollout, eval).

    Every node runs `--actor-num-gpus-per-node` ranks; `rollout_engines` / `eval_engines`: the node's share of
    each group (default: the whole group, a single node)."""
    cluster = config.cluster
    demands: list[GpuDemand] = []
    if config.needs_train_ranks and ranks_on_gpu:
        demands.append(GpuDemand("train", "training ranks",
                                 f"--actor-num-gpus-per-node {cluster.actor_num_gpus_per_node}",
                                 cluster.actor_num_gpus_per_node, 1))
    per_engine = cluster.rollout_num_gpus_per_engine
    share = "" if cluster.actor_num_nodes == 1 else ", this node's share"
    rollout_count = config.num_launched_rollout_engines if rollout_engines is None else rollout_engines
    eval_count = config.num_eval_engines if eval_engines is None else eval_engines
    groups = deployment(config) if config.sglang.sglang_config is not None else None
    if rollout is not None and rollout.on_gpu and rollout_count:
        demands.append(_engine_demand("rollout", "rollout engines",
                                      f"--rollout-num-gpus {cluster.rollout_num_gpus}{share}", rollout_count,
                                      per_engine, groups, whole=rollout_count == config.num_launched_rollout_engines))
    if eval_ is not None and eval_.on_gpu and eval_count:
        demands.append(_engine_demand("eval", "eval engines", f"--eval-num-gpus {config.eval.eval_num_gpus}{share}",
                                      eval_count, config.eval.eval_num_gpus_per_engine, groups,
                                      whole=eval_count == config.num_eval_engines))
    return demands


def _engine_demand(group: str, what: str, flags: str, count: int, per_engine: int, groups: Deployment | None, *,
                   whole: bool) -> GpuDemand:
    """An engine group's demand; with `--sglang-config` groups, each engine of its own size and the
    placeholders' GPUs held (on one node only: several nodes get engines of one size, no placeholder)."""
    if groups is None or not groups.groups_of(group):
        return GpuDemand(group, what, flags, count, per_engine)
    sizes = {size for _, size in groups.layout(group)}
    if not whole:  # a node's share of a multi-node fleet: engines of one size (sglang_file refuses others)
        return GpuDemand(group, what, flags, count, sizes.pop())
    return GpuDemand(group, what, f"{groups.source}{' (its eval model)' if group == 'eval' else ''}", count,
                     max(sizes), shape=groups.layout(group), span=groups.span(group))


def oversubscribed_message(demands: Sequence[GpuDemand], needed: int, gpus: GpuInventory, *,
                           colocated: bool = False) -> str:
    parts = {}
    for demand in demands:
        what = demand.what if demand.units != 1 else demand.what.removesuffix("s")
        if demand.shape:
            sizes = "+".join(str(size) for _, size in demand.layout)
            reserved = demand.total - sum(size for _, size in demand.layout)
            part = (f"{demand.flags} ({demand.units} {what} of {sizes} GPUs"
                    + (f", {reserved} reserved by placeholder groups" if reserved else "") + f": {demand.total})")
        elif demand.per_unit > 1:
            per_flag = "--eval-num-gpus-per-engine" if demand.group == "eval" else "--rollout-num-gpus-per-engine"
            part = f"{demand.flags} ({demand.units} {what} × {per_flag} {demand.per_unit})"
        else:
            part = f"{demand.flags} ({demand.units} {what})"
        parts[demand.group] = part
    if colocated and "train" in parts and "rollout" in parts:
        shared = max(d.total for d in demands if d.group in ("train", "rollout"))
        parts = {"shared": f"{parts.pop('train')} and {parts.pop('rollout')} sharing GPUs under --colocate "
                           f"({shared})", **parts}
    shows = f"{gpus.count}" if gpus.count else "none"
    message = (f"the placement plan needs {needed} GPUs on this node but it shows {shows} ({gpus.source}): "
               f"{' + '.join(parts.values())} = {needed}; lower one of them, or make more GPUs visible "
               "(CUDA_VISIBLE_DEVICES" + (", --num-gpus-per-node" if "--num-gpus-per-node" in gpus.source else "")
               + ")")
    if gpus.count == 0 and any(d.group != "train" for d in demands):
        message += "; without GPUs, give --rollout-num-engines N for CPU engines instead of --rollout-num-gpus"
    return message
