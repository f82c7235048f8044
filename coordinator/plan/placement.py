"""The placement plan: every process the run launches, its GPUs, ports, environment and command line.

Owns `build_plan` (computed once at start-up from the config and the GPUs the node shows) and the frozen
plan it returns. The run launches exactly what the plan says — each engine from its slot's
`EngineLaunchSpec`, the torchrun child from the ranks' slot, the router from its slot — and `--dry-run`
prints the same objects, so what is shown is what would run.

How GPUs are placed:
- GPU positions are indices among the GPUs the coordinator sees (`GpuInventory`); a child that must see a
  subset gets `CUDA_VISIBLE_DEVICES` built from the inventory's ids (the training ranks: their GPUs, in
  LOCAL_RANK order; our engine on CUDA: its one GPU), SGLang gets `--base-gpu-id` and `--tp-size`.
- Demands are placed in slime's order — training ranks first, then rollout engines, then eval engines — by
  a placement policy (`POLICIES`), a function from the demands to GPU positions per unit, nothing else.
  `separate` gives each demand its own consecutive GPUs; `colocate` (`--colocate`) puts the rollout engines
  on the training ranks' GPUs (engine i on the ranks' GPUs i·tp .. i·tp + tp − 1) and the eval engines after.
- `--num-gpus-per-node` (miles) caps the GPUs a node is planned with, as CUDA_VISIBLE_DEVICES would.
- The plan is per node (`PlacementPlan.nodes` holds this node's `NodePlan`). Every node runs
  `--actor-num-gpus-per-node` ranks; each engine group is split over the nodes in contiguous blocks, as evenly
  as it goes, the first nodes taking one more (`engine_share`): engine i has the same name on every node's
  plan, so node 0's fleets know the engines the other nodes launch (`PlacementPlan.remote_engines`). A
  multi-node plan carries its `NodeLayout` (`coordinator.nodes.layout`): how the nodes find node 0.

Invariants: GPUs of different processes are disjoint under `separate`, and under `colocate` only a rank and
the rollout engine placed on its GPU share one (a colocated weight update never uses NCCL between them:
NCCL refuses two processes on one GPU, "Duplicate GPU detected"); a plan that needs more GPUs than the
node shows raises `ConfigError` naming the flags and the numbers (exit 2, before anything launches), except
in a lenient (`--dry-run`) plan, which warns and places on the GPUs the plan needs; secrets never appear in
`describe()` output (commands and environments are masked).
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from coordinator.config.fields import ConfigError
from coordinator.config.settings import Config
from coordinator.engines.launch import EngineLaunchSpec, engine_launch_spec, engine_log_path, free_port
from coordinator.engines.router import router_command, router_log_path
from coordinator.nodes.layout import TORCH_RDZV_STORE_ENV, NodeLayout, join_host_port, resolve_layout
from coordinator.plan.backend import EngineChoice, choose_engines, sglang_installed
from coordinator.plan.gpus import PLAN_GPU_COUNT_ENV, GpuInventory, detect_gpus
from coordinator.plan.nodes import engine_share, node_shares, remote_engines
from coordinator.plan.snapshots import SnapshotPlace, snapshot_place
from coordinator.train.group import rank_environment
from coordinator.train.torchrun import TorchrunSpec
from workers import protocol

ENGINE_HOST = "127.0.0.1"


# ----------------------------------------------------------------------------------------------------------
# GPU demands and the policies that place them
# ----------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class GpuDemand:
    """GPUs one kind of process asks for on a node: `units` processes (ranks or engines) of `per_unit` each."""

    group: str  # "train", "rollout", "eval"
    what: str  # "training ranks", "rollout engines", "eval engines"
    flags: str  # the flags that asked, as the user wrote them: "--rollout-num-gpus 4"
    units: int
    per_unit: int

    @property
    def total(self) -> int:
        return self.units * self.per_unit


#: A policy places demands: for each demand's group, the GPU positions of each of its units.
Policy = Callable[[Sequence[GpuDemand]], dict[str, tuple[tuple[int, ...], ...]]]


def place_separately(demands: Sequence[GpuDemand]) -> dict[str, tuple[tuple[int, ...], ...]]:
    """Each demand on its own consecutive GPUs, in the order given: nothing shares a GPU."""
    placed: dict[str, tuple[tuple[int, ...], ...]] = {}
    position = 0
    for demand in demands:
        units = []
        for _ in range(demand.units):
            units.append(tuple(range(position, position + demand.per_unit)))
            position += demand.per_unit
        placed[demand.group] = tuple(units)
    return placed


def place_colocated(demands: Sequence[GpuDemand]) -> dict[str, tuple[tuple[int, ...], ...]]:
    """Training ranks and rollout engines both from GPU 0 (the engines on the ranks' GPUs); eval engines after
    every GPU either uses."""
    placed: dict[str, tuple[tuple[int, ...], ...]] = {}
    position = 0
    for demand in demands:
        start = 0 if demand.group in ("train", "rollout") else position
        placed[demand.group] = tuple(tuple(range(start + unit * demand.per_unit, start + (unit + 1) * demand.per_unit))
                                     for unit in range(demand.units))
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
    if rollout is not None and rollout.on_gpu and rollout_count:
        demands.append(GpuDemand("rollout", "rollout engines",
                                 f"--rollout-num-gpus {cluster.rollout_num_gpus}{share}", rollout_count, per_engine))
    if eval_ is not None and eval_.on_gpu and eval_count:
        demands.append(GpuDemand("eval", "eval engines", f"--eval-num-gpus {config.eval.eval_num_gpus}{share}",
                                 eval_count, per_engine))
    return demands


# ----------------------------------------------------------------------------------------------------------
# The plan
# ----------------------------------------------------------------------------------------------------------
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
        return self.spec.command()

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

    @property
    def gpus_needed(self) -> int:
        used = [gpu for slot in self.processes() for gpu in slot.gpus]
        return max(used) + 1 if used else 0

    def processes(self) -> Iterator[RanksSlot | EngineSlot | RouterSlot]:
        if self.ranks is not None:
            yield self.ranks
        yield from self.rollout_engines
        yield from self.eval_engines
        if self.router is not None:
            yield self.router


@dataclass(frozen=True)
class WeightSyncPlan:
    mode: str  # --update-weight-transfer-mode
    bucket_bytes: int  # --update-weight-buffer-size
    detail: str
    #: where disk snapshots go (`coordinator.plan.snapshots`): a tmpfs directory in colocation, else the run dir
    snapshots: SnapshotPlace


@dataclass(frozen=True)
class SwapPlan:
    """The memory hand-over of each step (`coordinator.colocate`): who gives memory back while the other works."""

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


def build_plan(config: Config, gpus: GpuInventory, *, has_sglang: bool | None = None, lenient: bool = False,
               python: str = sys.executable, layout: NodeLayout | None = None,
               layout_warnings: Sequence[str] = ()) -> PlacementPlan:
    """The plan for this node. Raises ConfigError (exit 2) for a plan that cannot run here, unless `lenient`
    (`--dry-run`), which records a warning instead and plans as a node with enough GPUs would run.
    A multi-node config is planned with its `layout` (`resolve_layout`: this node's rank, node 0's address),
    resolved here from the environment when not given."""
    if layout is None and config.cluster.actor_num_nodes > 1:
        config, layout, found = resolve_layout(config, lenient=lenient)
        layout_warnings = [*layout_warnings, *found]
    has_sglang = sglang_installed() if has_sglang is None else has_sglang
    rollout, eval_, warnings = choose_engines(config, has_sglang=has_sglang, lenient=lenient)
    warnings = [*layout_warnings, *warnings]
    policy = "colocate" if config.colocated else "separate"
    gpus = gpus.at_most(config.cluster.num_gpus_per_node)
    node = plan_node(config, config.cluster.actor_node_rank, gpus, rollout, eval_, policy=policy,
                     lenient=lenient, warnings=warnings, python=python, layout=layout)
    _check_colocated_transfer(config, node, lenient=lenient, warnings=warnings)
    swap = SwapPlan(offload_train=config.offloads_train, offload_rollout=config.offloads_rollout,
                    train_memory_margin_bytes=config.cluster.train_memory_margin_bytes) \
        if config.swaps_memory else None
    return PlacementPlan(policy=policy, nodes=(node,), node_rank=node.node_rank, rollout_choice=rollout,
                         eval_choice=eval_, external_engines=_external(config), weight_sync=_weight_sync(config),
                         warnings=tuple(warnings), lenient=lenient, swap=swap, layout=layout,
                         remote_engines=remote_engines(config, node.node_rank, rollout, eval_),
                         shares=node_shares(config, rollout, eval_))


def plan_node(config: Config, node_rank: int, gpus: GpuInventory, rollout: EngineChoice | None,
              eval_: EngineChoice | None, *, policy: str, lenient: bool, warnings: list[str],
              python: str = sys.executable, layout: NodeLayout | None = None) -> NodePlan:
    """One node's share: its ranks, its share of each engine group (`engine_share`), and the router on the
    coordinator's node (node 0)."""
    nodes = config.cluster.actor_num_nodes
    rollout_indices = engine_share(config.num_launched_rollout_engines, nodes, node_rank) if rollout else range(0)
    eval_indices = engine_share(config.num_eval_engines, nodes, node_rank) if eval_ else range(0)
    if not rollout_indices:
        rollout = None
    if not eval_indices:
        eval_ = None
    any_engine_on_gpu = any(choice is not None and choice.on_gpu for choice in (rollout, eval_))
    ranks_on_gpu = gpus.count > 0 or any_engine_on_gpu
    demands = tuple(gpu_demands(config, rollout, eval_, ranks_on_gpu=ranks_on_gpu,
                                rollout_engines=len(rollout_indices), eval_engines=len(eval_indices)))
    placed = POLICIES[policy](demands)
    needed = max((gpu for units in placed.values() for unit in units for gpu in unit), default=-1) + 1
    if needed > gpus.count:
        message = oversubscribed_message(demands, needed, gpus, colocated=policy == "colocate")
        if not lenient:
            raise ConfigError(message)
        warnings.append(message)
        gpus = GpuInventory.of_count(needed, f"{needed} assumed for this plan; this machine shows "
                                     f"{gpus.describe()}")
    run_dir = config.logging.resolved_run_dir
    ranks = _ranks_slot(config, node_rank, placed.get("train", ()), gpus, run_dir, python, lenient=lenient,
                        warnings=warnings, layout=layout) \
        if config.needs_train_ranks else None
    host = _engine_host(layout, lenient=lenient, warnings=warnings) if rollout or eval_ else ENGINE_HOST
    rollout_slots = _engine_slots(config, "rollout", rollout_indices, rollout,
                                  placed.get("rollout", ()), gpus, python, host) if rollout is not None else ()
    eval_slots = _engine_slots(config, "eval", eval_indices, eval_, placed.get("eval", ()), gpus,
                               python, host) if eval_ is not None else ()
    router = None
    # --sglang-router-ip/-port attach to a running router: nothing to launch for it
    if node_rank == 0 and config.sglang.use_sglang_router and config.sglang.router_address is None \
            and config.needs_engines:
        router = RouterSlot(host=ENGINE_HOST, port=free_port(ENGINE_HOST), prometheus_port=free_port(ENGINE_HOST),
                            policy=config.sglang.sglang_router_policy, log=router_log_path(run_dir, "rollout"),
                            python=python, extra_args=config.router_passthrough)
    return NodePlan(node_rank=node_rank, gpus=gpus, demands=demands, ranks=ranks, rollout_engines=rollout_slots,
                    eval_engines=eval_slots, router=router)


def oversubscribed_message(demands: Sequence[GpuDemand], needed: int, gpus: GpuInventory, *,
                           colocated: bool = False) -> str:
    parts = {}
    for demand in demands:
        what = demand.what if demand.units != 1 else demand.what.removesuffix("s")
        if demand.per_unit > 1:
            part = f"{demand.flags} ({demand.units} {what} × --rollout-num-gpus-per-engine {demand.per_unit})"
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


def _ranks_slot(config: Config, node_rank: int, units: tuple[tuple[int, ...], ...], gpus: GpuInventory,
                run_dir: Path, python: str, *, lenient: bool, warnings: list[str],
                layout: NodeLayout | None = None) -> RanksSlot:
    cluster = config.cluster
    positions = tuple(unit[0] for unit in units)
    rdzv_endpoint = cluster.rdzv_endpoint
    if cluster.actor_num_nodes > 1 and not rdzv_endpoint:
        message = (f"--actor-num-nodes {cluster.actor_num_nodes} needs --rdzv-endpoint HOST:PORT (torchrun's "
                   "rendezvous, reachable from every node)")
        if not lenient:
            raise ConfigError(message)
        warnings.append(message)  # a login node's dry run: the launcher's node knows the address
        rdzv_endpoint = "<--rdzv-endpoint>"
    multi = cluster.actor_num_nodes > 1
    # node 0's torchrun hosts the rendezvous store; the others only dial it (never a race to host it)
    rdzv_conf = (("is_host", "1" if node_rank == 0 else "0"),) if multi else ()
    spec = TorchrunSpec(nproc_per_node=cluster.actor_num_gpus_per_node, nnodes=cluster.actor_num_nodes,
                        node_rank=node_rank, rdzv_endpoint=rdzv_endpoint, rdzv_conf=rdzv_conf,
                        max_restarts=config.fault_tolerance.max_restarts if config.train_ft_enabled else 0,
                        python=python)
    env = config.train.train_env  # --train-env-vars first: the GPUs and the rendezvous below are rayless'
    env += (("CUDA_VISIBLE_DEVICES", gpus.visible_devices(positions)),) if positions else ()
    if multi:
        env += ((protocol.ENV_NODE_RANK, str(node_rank)), TORCH_RDZV_STORE_ENV)
    fixed = cluster.control_port != 0
    # a free port is looked for here only on a single node (multi-node ports are fixed by the layout)
    port = cluster.control_port if fixed else free_port(cluster.control_host)
    return RanksSlot(gpus=positions, device="cuda" if positions else "cpu", spec=spec, env=env,
                     control_host=cluster.control_host, control_port=port, control_port_fixed=fixed,
                     log=run_dir / (f"train_ranks-node{node_rank}.log" if multi else "train_ranks.log"),
                     dial_host=layout.control_host if layout is not None else None)


def _engine_host(layout: NodeLayout | None, *, lenient: bool, warnings: list[str]) -> str:
    if layout is None:
        return ENGINE_HOST
    try:
        return layout.engine_host()
    except OSError as error:
        message = (f"node {layout.node_rank}'s engines listen where node 0 reaches them, but there is no route from "
                   f"here to node 0 ({layout.control_host}): {error.strerror or error}")
        if not lenient:
            raise ConfigError(message) from None
        warnings.append(message)
        return "<ADDRESS_TOWARD_NODE_0>"


def _engine_slots(config: Config, group: str, indices: range, choice: EngineChoice,
                  units: tuple[tuple[int, ...], ...], gpus: GpuInventory, python: str,
                  host: str = ENGINE_HOST) -> tuple[EngineSlot, ...]:
    """This node's engines of `group`: engine i (of the whole group) is named `<group>-<i>` on every node."""
    run_dir = config.logging.resolved_run_dir
    slots = []
    for position, index in enumerate(indices):
        name = f"{group}-{index}"
        positions = units[position] if choice.on_gpu else ()
        releases = group == "rollout" and config.offloads_rollout
        spec = engine_launch_spec(
            model_path=str(config.rollout.hf_checkpoint), sglang=config.sglang, cluster=config.cluster,
            seed=config.rollout.rollout_seed, enable_metrics=config.health_monitor_enabled,
            backend=choice.backend, device=choice.device, gpus=positions,
            visible_devices=gpus.visible_devices(positions) if positions else None, port=free_port(ENGINE_HOST),
            release_memory=releases,
            # released weights of our CPU engine go to a file on disk, so the memory is freed, not moved to tmpfs
            spill_dir=str(run_dir / "engine-spill" / name) if releases and choice.device == "cpu" else None)
        if python != spec.python or host != spec.host:
            spec = dataclasses.replace(spec, python=python, host=host)
        slots.append(EngineSlot(name=name, group=group, gpus=positions, choice=choice, spec=spec,
                                log=engine_log_path(run_dir, name)))
    return tuple(slots)


def _external(config: Config) -> tuple[str, ...]:
    return config.cluster.rollout_external_engine_addrs if config.needs_engines else ()


def _weight_sync(config: Config) -> WeightSyncPlan | None:
    if not (config.needs_engines and config.needs_train_ranks):
        return None
    sglang = config.sglang
    mode = sglang.update_weight_transfer_mode
    snapshots = snapshot_place(run_dir=config.logging.resolved_run_dir, model_path=config.rollout.hf_checkpoint,
                               keep=config.checkpoint.keep_weight_snapshots,
                               colocated=config.colocated and mode == "disk",
                               nodes=config.cluster.actor_num_nodes)
    if mode == "disk":
        detail = (f"rank 0 writes a safetensors snapshot under {snapshots.directory} ({snapshots.why}); "
                  "every engine loads it (/update_weights_from_disk)")
        if config.colocated:
            detail += ("; colocated, so the snapshot is written before the ranks offload and read once the "
                       "engines have their weights back")
    else:
        detail = ("rank 0 sends the weights over a process group the engines join "
                  "(/init_weights_update_group, /update_weights_from_distributed); a fresh group on a free "
                  "port per update")
    return WeightSyncPlan(mode=mode, bucket_bytes=sglang.update_weight_buffer_size, detail=detail,
                          snapshots=snapshots)


def _check_colocated_transfer(config: Config, node: NodePlan, *, lenient: bool, warnings: list[str]) -> None:
    """A distributed update between a rank and an engine on the same GPU would need NCCL between two processes
    on one device, which NCCL refuses ("Duplicate GPU detected"); colocated CPU processes use gloo."""
    if not config.colocated or config.sglang.update_weight_transfer_mode not in ("distributed", "broadcast"):
        return
    on_gpu = (node.ranks is not None and node.ranks.device == "cuda") or any(s.gpus for s in node.rollout_engines)
    if not on_gpu:
        return
    message = (f"--colocate with --update-weight-transfer-mode {config.sglang.update_weight_transfer_mode}: a "
               "rank and the engine on its GPU cannot form an NCCL group (NCCL refuses two processes on one GPU), "
               "so colocated weights move by disk: drop --update-weight-transfer-mode (disk is the default; "
               "snapshots go through /dev/shm)")
    if not lenient:
        raise ConfigError(message)
    warnings.append(message)


# ----------------------------------------------------------------------------------------------------------
# Entry points: a launch, a dry run
# ----------------------------------------------------------------------------------------------------------
def needs_gpu_probe(config: Config) -> bool:
    """Whether the flags put engines on GPUs (then torch may be asked for the count when no driver tool is)."""
    if config.cluster.engine_backend == "cpu" or not config.needs_engines:
        return False
    return config.cluster.rollout_num_gpus is not None or config.eval.eval_num_gpus > 0


def plan_for_launch(config: Config, layout: NodeLayout | None = None) -> PlacementPlan:
    """The plan a run launches from; ConfigError (exit 2) when it cannot run on this node. A multi-node
    `config` must be the one `resolve_layout` returned with `layout` (or is resolved here)."""
    gpus = detect_gpus(probe_torch=needs_gpu_probe(config))
    if gpus.injected:
        raise ConfigError(f"{PLAN_GPU_COUNT_ENV} is set: it injects a GPU count for planning tests and "
                          "--dry-run only; unset it to launch")
    return build_plan(config, gpus, layout=layout)


def plan_for_dry_run(config: Config, layout: NodeLayout | None = None,
                     layout_warnings: Sequence[str] = ()) -> PlacementPlan:
    """The plan `--dry-run` prints: what this node lacks is a warning, not an error."""
    return build_plan(config, detect_gpus(probe_torch=False), lenient=True, layout=layout,
                      layout_warnings=layout_warnings)
