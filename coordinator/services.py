"""The run's services: each built complete, in one place, then started in one order.

Owns `Services`, the frozen record of what a run has (each piece None where its mode needs none), and the two
steps that make it: `build_processes` constructs everything that launches or talks to a process (the engine
client's fleets, the router, the training ranks, the weight sync, the colocated hand-over, node 0's registry)
without starting any of it; `start_processes` starts them in the run's order, concurrently where they are
independent, while the tokenizer loads; `build_fault_tolerance` then builds what needs the tokenizer and the
weight sync (the eval fleet, the health monitors, the fault injector). `StartupClock` is the one owner of the
start-up timings. Invariant: no service is patched after it is built, and none starts before every service
it depends on is built.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio

if TYPE_CHECKING:
    from anyio.abc import TaskGroup

    from coordinator.config import Config
    from coordinator.engines.client import EngineClient
    from coordinator.engines.fleet import EngineFleet
    from coordinator.engines.health import FaultInjector, HealthMonitor
    from coordinator.engines.router import RouterHandle
    from coordinator.eval.fleet import EvalFleet
    from coordinator.nodes.head import Head
    from coordinator.observe.progress import MetricsLog, ProgressDisplay
    from coordinator.plan import PlacementPlan
    from coordinator.train.commands import TrainCommands
    from coordinator.train.group import TrainGroup
    from coordinator.weights.colocate import Colocation
    from coordinator.weights.sync import WeightSync


class StartupClock:
    """Seconds since the run began, per named start-up milestone (`summary.json`'s `*_s` entries)."""

    def __init__(self) -> None:
        self.started = time.monotonic()
        self.marks: dict[str, float] = {}

    def mark(self, name: str) -> None:
        self.marks[name] = time.monotonic() - self.started

    def since(self, name: str, started: float) -> None:
        """Record `name` as a duration from `started` (a monotonic time), not from the run's start."""
        self.marks[name] = time.monotonic() - started


@dataclass(frozen=True)
class FaultTolerance:
    """The FT pieces of one run, each present only where its gate in Config says so."""

    monitors: list[HealthMonitor] = field(default_factory=list)
    injector: FaultInjector | None = None
    eval_fleet: EvalFleet | None = None

    def summary(self, weight_sync: WeightSync | None) -> dict[str, Any]:
        return {
            "monitors": [m.group for m in self.monitors],
            "monitor_stats": {m.group: dataclasses.asdict(m.stats) for m in self.monitors},
            "injection_armed": bool(self.injector is not None and self.injector.armed),
            "injected": list(self.injector.killed) if self.injector is not None else [],
            "weight_sync_recoveries": weight_sync.recoveries if weight_sync is not None else 0,
            "eval_probes": self.eval_fleet.probes if self.eval_fleet is not None else 0,
            "evals": [dataclasses.asdict(r) for r in self.eval_fleet.records] if self.eval_fleet is not None
            else [],
        }


@dataclass(frozen=True)
class Processes:
    """What launches or talks to a process, built complete before anything starts."""

    client: EngineClient | None = None
    fleet: EngineFleet | None = None
    eval_engines: EngineFleet | None = None  # the EngineFleet of group "eval"
    teacher_engines: EngineFleet | None = None  # group "teacher": on-policy distillation's, never trained
    router: RouterHandle | None = None
    train_group: TrainGroup | None = None
    weight_sync: WeightSync | None = None
    colocation: Colocation | None = None  # the memory hand-over of a swapping run (--colocate)
    #: node 0 of a multi-node run: the token, the node registry and what the services take from them
    nodes: Head | None = None


@dataclass(frozen=True)
class Services(Processes):
    """Everything the run started; read by the loop's wiring and by tests' step hooks."""

    tokenizer: Any = None
    context_length: int | None = None
    ft: FaultTolerance = field(default_factory=FaultTolerance)


def build_processes(config: Config, plan: PlacementPlan, run_dir: Path, *, client: EngineClient | None,
                    nodes: Head | None, progress: ProgressDisplay) -> Processes:
    """Every process-owning service of the plan, constructed and wired to each other; nothing started."""
    fleet = eval_engines = teacher_engines = router = None
    if config.needs_engines:
        assert client is not None, "a run with engines opens the engine client first"
        fleet = _fleet(config, plan, run_dir, client, nodes, progress, "rollout")
        if config.eval_fleet_enabled:  # dedicated eval engines: their own group and GPUs; never trained weights
            eval_engines = _fleet(config, plan, run_dir, client, nodes, progress, "eval")
        if plan.local.teacher_engines:  # --opd-teacher-load of --opd-type sglang: the teacher, never trained
            teacher_engines = _fleet(config, plan, run_dir, client, nodes, progress, "teacher")
        router = _router(config, plan, run_dir, client, progress)
    train_group = _train_group(plan, run_dir, nodes, progress) if config.needs_train_ranks else None
    weight_sync = None
    if fleet is not None and train_group is not None and client is not None:
        weight_sync = build_weight_sync(config, plan, run_dir, fleet=fleet, client=client, router=router,
                                        trainer=train_group.commands, nodes=nodes)
    colocation = None
    if config.swaps_memory and fleet is not None and train_group is not None and client is not None:
        from coordinator.weights.colocate import Colocation

        colocation = Colocation(
            fleet=fleet, client=client, trainer=train_group.commands, weight_sync=weight_sync,
            offload_train=config.offloads_train, offload_rollout=config.offloads_rollout,
            recovers_engines=config.rollout_ft_enabled, on_phase=progress.run.set_phase)
    return Processes(client=client, fleet=fleet, eval_engines=eval_engines, teacher_engines=teacher_engines,
                     router=router, train_group=train_group,
                     weight_sync=weight_sync, colocation=colocation, nodes=nodes)


def _fleet(config: Config, plan: PlacementPlan, run_dir: Path, client: EngineClient, nodes: Head | None,
           progress: ProgressDisplay, group: str) -> EngineFleet:
    from coordinator.engines.fleet import EngineFleet

    slots = {"rollout": plan.local.rollout_engines, "eval": plan.local.eval_engines,
             "teacher": plan.local.teacher_engines}[group]
    fleet = EngineFleet(
        client=client, group=group, launch=[slot.spec for slot in slots],
        external_urls=plan.external_engines if group == "rollout" else (), run_dir=run_dir,
        probe_timeout=config.fault_tolerance.rollout_health_check_timeout, observer=progress.board,
        **(nodes.fleet_kwargs(group) if nodes is not None else {}))
    if nodes is not None:
        nodes.watch(fleet)
    return fleet


def _router(config: Config, plan: PlacementPlan, run_dir: Path, client: EngineClient,
            progress: ProgressDisplay) -> RouterHandle | None:
    sglang, slot = config.sglang, plan.local.router
    if sglang.router_address is None and slot is None:
        return None
    from coordinator.engines.router import RouterHandle

    if sglang.router_address is not None:  # attached: our engines join it, and leave it when the run ends
        return RouterHandle(client=client, run_dir=run_dir, policy=sglang.sglang_router_policy,
                            address=sglang.router_address, observer=progress.board)
    assert slot is not None
    return RouterHandle(client=client, run_dir=run_dir, name="rollout", policy=slot.policy, host=slot.host,
                        port=slot.port, prometheus_port=slot.prometheus_port, python=slot.python,
                        observer=progress.board, extra_args=slot.extra_args)


def _train_group(plan: PlacementPlan, run_dir: Path, nodes: Head | None, progress: ProgressDisplay) -> TrainGroup:
    from coordinator.train.group import TrainGroup

    slot = plan.local.ranks
    assert slot is not None, "the plan places training ranks whenever the run trains"
    return TrainGroup(
        slot.spec, host=slot.control_host, port=slot.control_port, port_fixed=slot.control_port_fixed,
        extra_env=dict(slot.env), run_dir=run_dir, log_name=slot.log.name, observer=progress.board,
        **(nodes.rank_kwargs() if nodes is not None else {}))


def build_weight_sync(config: Config, plan: PlacementPlan | None, run_dir: Path, *, fleet: EngineFleet,
                      client: EngineClient, router: RouterHandle | None, trainer: TrainCommands,
                      nodes: Head | None = None) -> WeightSync:
    """WeightSync for the rollout engines; it recovers dead engines only with rollout FT (the config's gate)."""
    from coordinator.weights.sync import WeightSync

    sglang = config.sglang
    snapshot_dir = plan.weight_sync.snapshots.directory if plan is not None and plan.weight_sync is not None \
        else run_dir / "weights"
    return WeightSync(
        mode=sglang.update_weight_transfer_mode, fleet=fleet, client=client, trainer=trainer,
        snapshot_dir=snapshot_dir, keep_snapshots=config.checkpoint.keep_weight_snapshots,
        recover_engines=config.rollout_ft_enabled, router=router, bucket_bytes=sglang.update_weight_buffer_size,
        join_timeout_s=sglang.update_weight_join_timeout, ack_timeout_s=sglang.update_weight_ack_timeout,
        backend=weight_backend(plan), pause_mode=sglang.pause_generation_mode,
        update_mode=plan.weight_sync.update_mode if plan is not None and plan.weight_sync is not None
        else sglang.update_weight_mode,
        delta_encoding=sglang.update_weight_delta_encoding,
        host=nodes.weight_host if nodes is not None else "127.0.0.1",
    )


def weight_backend(plan: PlacementPlan | None) -> str:
    """A distributed sync uses NCCL when the plan puts the ranks and every launched engine on CUDA (and no engine
    is attached from elsewhere, whose device is unknown), gloo otherwise."""
    node = plan.local if plan is not None else None
    if node is None or node.ranks is None or node.ranks.device != "cuda" or plan.external_engines:
        return "gloo"
    if plan.policy == "colocate":
        return "gloo"  # NCCL refuses two processes on one GPU (the plan refuses distributed sync there anyway)
    engines = node.rollout_engines
    return "nccl" if engines and all(slot.choice.on_gpu for slot in engines) else "gloo"


async def start_processes(config: Config, processes: Processes, task_group: TaskGroup,
                          clock: StartupClock) -> tuple[Any, int | None]:
    """Start what `build_processes` built, in the run's order: node 0's registry first (other nodes report to
    it), then engines (then the router over them) and the ranks (then their init) concurrently, while the
    tokenizer loads. A colocated run releases the engines' memory before the ranks load the model into it,
    and settles last. Returns the tokenizer and the context length."""
    p = processes
    if p.nodes is not None:
        await p.nodes.start(task_group, p.train_group)
    loaded: list[tuple[Any, int | None]] = []

    async def start_engines(fleet: EngineFleet, milestone: str) -> None:
        await task_group.start(fleet.run)
        clock.mark(milestone)
        if fleet is p.fleet and p.router is not None:
            await task_group.start(p.router.run, [e.url for e in fleet.alive()])
        if fleet is p.fleet and p.colocation is not None:
            await p.colocation.release_at_startup()  # the ranks load the model into the memory freed

    async def start_ranks(group: TrainGroup) -> None:
        from coordinator.hooks.args import tis_hook_args
        from coordinator.train.settings import train_settings

        await task_group.start(group.run)
        clock.mark("ranks_ready_s")
        if p.colocation is not None:
            await p.colocation.startup_released.wait()
        await group.commands.init(train_settings(config, tis_hook_args=tis_hook_args(config)))
        clock.mark("ranks_initialised_s")

    async def load_tokenizer() -> None:
        tokenizer, context, vocab = await anyio.to_thread.run_sync(_load_tokenizer, config)
        if p.client is not None:
            p.client.set_vocab_size(vocab)  # every /generate reply's ids are checked against it from now on
        loaded.append((tokenizer, context))

    async with anyio.create_task_group() as starting:
        if p.fleet is not None:
            starting.start_soon(start_engines, p.fleet, "engines_ready_s")
            starting.start_soon(load_tokenizer)
        if p.eval_engines is not None:
            starting.start_soon(start_engines, p.eval_engines, "eval_engines_ready_s")
        if p.teacher_engines is not None:
            starting.start_soon(start_engines, p.teacher_engines, "teacher_engines_ready_s")
        if p.train_group is not None:
            starting.start_soon(start_ranks, p.train_group)
    if p.colocation is not None:
        settling = time.monotonic()
        await p.colocation.settle_at_startup()
        clock.since("colocation_settled_s", settling)
    return loaded[0] if loaded else (None, None)


def _load_tokenizer(config: Config) -> tuple[Any, int | None, int]:
    """The tokenizer, the context length and the vocabulary engines sample from: the model's (its embedding
    may be padded past the tokenizer's) or the tokenizer's, whichever is larger."""
    from coordinator.data.tokenizer import load_tokenizer, read_model_fields

    tokenizer = load_tokenizer(config.rollout.hf_checkpoint)  # torch-free where the files decide the class
    fields = read_model_fields(config.rollout.hf_checkpoint)
    context = config.sglang.sglang_context_length or fields.max_position_embeddings
    return tokenizer, context, max(len(tokenizer), fields.vocab_size or 0)


def build_fault_tolerance(config: Config, processes: Processes, *, tokenizer: Any, run_dir: Path,
                          metrics: MetricsLog | None) -> FaultTolerance:
    """Monitors (rollout FT and engines only), the fault injector (always built when rollout engines exist, armed
    only by `config.fault_injection_armed`) and the eval fleet (probing itself unless a monitor watches it)."""
    p = processes
    if p.fleet is None or p.client is None:
        return FaultTolerance()
    from coordinator.engines.health import FaultInjector, build_health_monitors

    eval_fleet = None
    if p.eval_engines is not None:
        from coordinator.eval.fleet import EvalFleet
        from coordinator.eval.settings import EvalSettings

        eval_fleet = EvalFleet(
            settings=EvalSettings.from_slices(config.eval, rollout=config.rollout, sglang=config.sglang,
                                              save_hf=config.checkpoint.save_hf),
            fleet=p.eval_engines, client=p.client, tokenizer=tokenizer,
            exporter=p.train_group.commands if p.train_group is not None else None,
            snapshot_dir=Path(config.eval.eval_hf_dir) if config.eval.eval_hf_dir else run_dir / "eval_weights",
            metrics=metrics,
            probe_before_pin=not config.health_monitor_enabled,
        )
    monitors = build_health_monitors(
        config.fault_tolerance, enabled=config.health_monitor_enabled, client=p.client, rollout_fleet=p.fleet,
        rollout_recovery=p.weight_sync.recovery if p.weight_sync is not None else None, router=p.router,
        eval_fleet=p.eval_engines, eval_pauses=[eval_fleet] if eval_fleet is not None else [],
        rollout_pauses=[p.colocation] if p.colocation is not None else [],
    )
    return FaultTolerance(monitors=monitors, injector=FaultInjector.from_config(config, p.fleet),
                          eval_fleet=eval_fleet)
