"""The placement plan: every process the run launches, its GPUs, ports, environment and command line.

Owns `build_plan` (computed once at start-up from the config and the GPUs the node shows), which fills the
frozen records of `records`; the run launches exactly what they say and `--dry-run` prints the same objects.
Demands (`demands`) are placed in slime's order (ranks, rollout engines, eval engines) by a policy of
`demands.POLICIES` (`separate`, `colocate`), per node (`PlacementPlan.nodes`, `engine_share`). How GPUs are
placed: docs/placement.md.

Invariants: GPUs of different processes are disjoint under `separate`, and under `colocate` only a rank and the
rollout engine on its GPU share one; a plan that needs more GPUs than the node shows raises `ConfigError` naming
the flags and the numbers, except in a lenient (`--dry-run`) plan, which warns; secrets never appear in
`describe()` output.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Sequence
from pathlib import Path

from coordinator.config import determinism_rules as determinism
from coordinator.config.fields import ConfigError
from coordinator.config.settings import Config
from coordinator.config.sglang import TRANSFER_CARRIERS
from coordinator.config.sglang_file import Deployment, deployment
from coordinator.engines.spec import engine_launch_spec, engine_log_path, free_port, router_log_path
from coordinator.plan.backend import EngineChoice, choose_engines, sglang_installed
from coordinator.plan.demands import POLICIES, RESERVED, GpuDemand, gpu_demands, oversubscribed_message
from coordinator.plan.gpus import PLAN_GPU_COUNT_ENV, GpuInventory, detect_gpus
from coordinator.plan.layout import TORCH_RDZV_STORE_ENV, NodeLayout, resolve_layout
from coordinator.plan.nodes import engine_share, node_shares, remote_engines
from coordinator.plan.records import (
    EngineSlot,
    NodePlan,
    PlacementPlan,
    RanksSlot,
    RouterSlot,
    SwapPlan,
    WeightSyncPlan,
)
from coordinator.plan.snapshots import snapshot_place
from coordinator.train.torchrun import TorchrunSpec
from workers import protocol
from workers.boundary.exposure import beyond_loopback, exposure_problem

ENGINE_HOST = "127.0.0.1"


def _delta_engines(config: Config, backends: Sequence[str], warnings: list[str]) -> bool:
    """Whether `--update-weight-mode delta` runs as asked: only rayless' engines apply a delta (slime patches
    SGLang with a `/pull_weights` route for it; the SGLang rayless launches or attaches to has none), so SGLang
    engines take full updates, which leave them the same weights, with a warning."""
    if config.sglang.update_weight_mode != "delta":
        return True
    if config.cluster.colocate:
        raise ConfigError("--update-weight-mode=delta is not supported with --colocate (slime's rule: colocated "
                          "weights move without a copy, so the delta bookkeeping is pure overhead)")
    if "sglang" in backends or config.cluster.rollout_external_engine_addrs:
        which = "SGLang engines" if "sglang" in backends else "engines attached by --rollout-external-engine-addrs"
        warnings.append(f"--update-weight-mode delta: the {which} take full weight updates (only rayless' engines "
                        "apply a delta; slime patches SGLang with /pull_weights for it); --engine-backend rayless "
                        "for deltas")
        return False
    return True


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
    determinism.check_engine_backends(config, [choice.backend for choice in (rollout, eval_) if choice],
                                      sglang_version=determinism.installed_sglang_version() if has_sglang else None)
    warnings = [*layout_warnings, *warnings]
    weight_sync = _weight_sync(config)
    if not _delta_engines(config, [rollout.backend] if rollout else [], warnings) and weight_sync is not None:
        weight_sync = dataclasses.replace(weight_sync, update_mode="full")
    policy = "colocate" if config.colocated else "separate"
    gpus = gpus.at_most(config.cluster.num_gpus_per_node)
    node = plan_node(config, config.cluster.actor_node_rank, gpus, rollout, eval_, policy=policy,
                     lenient=lenient, warnings=warnings, python=python, layout=layout)
    _check_colocated_transfer(config, node, lenient=lenient, warnings=warnings)
    swap = SwapPlan(offload_train=config.offloads_train, offload_rollout=config.offloads_rollout,
                    train_memory_margin_bytes=config.cluster.train_memory_margin_bytes) \
        if config.swaps_memory else None
    return PlacementPlan(policy=policy, nodes=(node,), node_rank=node.node_rank, rollout_choice=rollout,
                         eval_choice=eval_, external_engines=_external(config), weight_sync=weight_sync,
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
    teacher = teacher_choice(config, node_rank, rollout or eval_)
    if teacher is not None and teacher.on_gpu:
        demands += (GpuDemand("teacher", "distillation teacher engine", "--opd-teacher-load", 1,
                              config.cluster.rollout_num_gpus_per_engine),)
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
    if problem := exposure_problem(host, has_key=bool(config.sglang.sglang_api_key),
                                   allowed=config.sglang.allow_unauthenticated,
                                   host_flag=f"node {node_rank}'s engines listen on", key_flag="--sglang-api-key"):
        if not lenient:
            raise ConfigError(problem)
        warnings.append(problem)
    rollout_slots = _engine_slots(config, "rollout", rollout_indices, rollout,
                                  placed.get("rollout", ()), gpus, python, host) if rollout is not None else ()
    eval_slots = _engine_slots(config, "eval", eval_indices, eval_, placed.get("eval", ()), gpus,
                               python, host) if eval_ is not None else ()
    teacher_slots = _engine_slots(config, "teacher", range(1), teacher, placed.get("teacher", ()), gpus, python,
                                  model_path=config.distill.teacher_path()) if teacher is not None else ()
    router = None
    # --sglang-router-ip/-port attach to a running router: nothing to launch for it; --sglang-router-port alone
    # launches it on that port (miles)
    if node_rank == 0 and config.sglang.launches_router and config.needs_engines:
        port = config.sglang.sglang_router_port or free_port(ENGINE_HOST)
        router = RouterSlot(host=ENGINE_HOST, port=port, prometheus_port=free_port(ENGINE_HOST),
                            policy=config.sglang.sglang_router_policy, log=router_log_path(run_dir, "rollout"),
                            python=python, extra_args=config.router_passthrough)
    reserved = placed.get(RESERVED, ((),))[0]
    return NodePlan(node_rank=node_rank, gpus=gpus, demands=demands, ranks=ranks, rollout_engines=rollout_slots,
                    eval_engines=eval_slots, router=router, teacher_engines=teacher_slots, reserved_gpus=reserved)


def teacher_choice(config: Config, node_rank: int, engines: EngineChoice | None) -> EngineChoice | None:
    """The engine kind of on-policy distillation's teacher, on node 0 when rayless serves it
    (`--opd-type sglang --opd-teacher-load`): the rollout engines' kind, which this node's flags chose."""
    if not (config.distill.launches_teacher and config.needs_engines and node_rank == 0):
        return None
    if engines is None:
        raise ConfigError("--opd-teacher-load with --opd-type sglang serves the teacher on an engine like the rollout "
                          "engines, and this run launches none (--rollout-num-engines / --rollout-num-gpus): "
                          "serve the teacher yourself and give --opd-teacher-urls")
    return engines


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
                  host: str = ENGINE_HOST, model_path: str | None = None) -> tuple[EngineSlot, ...]:
    """This node's engines of `group`: engine i (of the whole group) is named `<group>-<i>` on every node."""
    run_dir = config.logging.resolved_run_dir
    groups = deployment(config)  # --sglang-config: each engine's server group (its overrides, the model path)
    if model_path is None and groups is not None and group == "rollout":
        model_path = groups.rollout_model_path
    slots = []
    for position, index in enumerate(indices):
        name = f"{group}-{index}"
        positions = units[position] if choice.on_gpu else ()
        releases = group == "rollout" and config.offloads_rollout
        overrides = config.eval.eval_sglang_passthrough if group == "eval" else ()
        if groups is not None and group in ("rollout", "eval") and (group == "rollout" or groups.eval):
            overrides = groups.overrides_of(group, index)
        spec = engine_launch_spec(
            model_path=model_path or str(config.rollout.hf_checkpoint), sglang=config.sglang, cluster=config.cluster,
            seed=config.rollout.rollout_seed, enable_metrics=config.health_monitor_enabled,
            backend=choice.backend, device=choice.device, gpus=positions,
            visible_devices=gpus.visible_devices(positions) if positions else None, port=free_port(ENGINE_HOST),
            release_memory=releases,
            gpus_per_engine=_engine_size(config, groups, group, index),
            overrides=overrides,
            # released weights of our CPU engine go to a file on disk, so the memory is freed, not moved to tmpfs
            spill_dir=str(run_dir / "engine-spill" / name) if releases and choice.device == "cpu" else None)
        if python != spec.python or host != spec.host:
            spec = dataclasses.replace(spec, python=python, host=host)
        if choice.backend == "rayless" and not spec.api_key and beyond_loopback(host):
            # allowed by --allow-unauthenticated (checked above); our engine refuses such a host otherwise
            spec = dataclasses.replace(spec, extra_args=(*spec.extra_args, "--allow-unauthenticated"))
        if config.determinism.active:  # the engine's deterministic flags and the one pinned thread count
            spec = dataclasses.replace(
                spec, extra_args=spec.extra_args + determinism.engine_args(config, choice.backend),
                env=spec.env + determinism.engine_env(config))
        slots.append(EngineSlot(name=name, group=group, gpus=positions, choice=choice, spec=spec,
                                log=engine_log_path(run_dir, name)))
    return tuple(slots)


def _engine_size(config: Config, groups: Deployment | None, group: str, index: int) -> int | None:
    """Engine `index`'s GPUs (SGLang's `--tp-size`): its `--sglang-config` server group's, else the fleet's
    flag (None: `--rollout-num-gpus-per-engine`, which the spec reads)."""
    size = groups.size_of(group, index) if groups is not None and group in ("rollout", "eval") else None
    if size is not None:
        return size
    return config.eval.eval_num_gpus_per_engine if group == "eval" else None


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
    if mode == "disk" and sglang.update_weight_mode == "delta":
        detail = (f"rank 0 writes the tensors changed since the engines' version under {snapshots.directory} "
                  f"({snapshots.why}; the first update a full snapshot); every engine applies them "
                  "(/update_weights_from_disk, load_format rayless_delta)")
    elif mode == "disk":
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
                          snapshots=snapshots, update_mode=sglang.update_weight_mode)


def _check_colocated_transfer(config: Config, node: NodePlan, *, lenient: bool, warnings: list[str]) -> None:
    """A distributed update between a rank and an engine on the same GPU would need NCCL between two processes
    on one device, which NCCL refuses ("Duplicate GPU detected"); colocated CPU processes use gloo."""
    if not config.colocated or TRANSFER_CARRIERS.get(config.sglang.update_weight_transfer_mode) != "distributed":
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
