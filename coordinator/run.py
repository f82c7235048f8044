"""`rayless train`: wires the run's services in one anyio task group and runs the training loop.

Owns the wiring order and the run directory. Every process launched comes from the placement plan
(`coordinator.plan`, computed once at start-up; written to `<run_dir>/plan.txt`): engines from its engine
slots, torchrun from its ranks slot, the router from its router slot. Services start concurrently (engines,
router, training ranks), each through `task_group.start(service.run)`, reporting their phases to the
progress display's start-up board, so the loop begins only once everything it uses is ready;
leaving the block — normally, on error or on a stop signal — cancels the group, and each service ends the
processes it launched (a stop signal cancels it through `coordinator.stop_signals`; the exit status is then
128 + the signal). A swapping run (`--colocate`, `coordinator.colocate`) starts in a fixed order instead: engines
up, their memory released, then the ranks load the model, offload it, and the engines take their memory back; its
weight snapshots go where the plan says (a private /dev/shm directory, removed when the run ends). Only what the
mode needs is started: replay starts no engine, router, health monitor, eval fleet or HTTP client;
`--debug-rollout-only` starts no training ranks. Fault-tolerance pieces are built in
`build_fault_tolerance` from the config's derived gates only (health monitors, the fault injector, the eval
fleet's own probing), and `build_weight_sync` gives WeightSync its `recover_engines` gate. Without an eval
fleet, `--eval-interval` evaluates on the rollout engines (`coordinator.rollout_eval`, slime's default): once
before the loop when it starts at rollout 0, then as a step hook.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import secrets as token_source
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio

from coordinator.config import Config, write_resolved_config
from coordinator.config.secrets import SecretMaskFilter, config_secrets
from coordinator.failures import ToFileOnly, failure_line, log_failure
from coordinator.nodes.head import reporting_outcome
from coordinator.processes import leaf_exceptions
from workers.errors import RaylessError

if sys.version_info < (3, 11):
    from exceptiongroup import BaseExceptionGroup
from coordinator.progress import MetricsLog, ProgressDisplay, plot_rewards, stderr_console
from coordinator.stop_signals import run_until_signalled

if TYPE_CHECKING:
    from anyio.abc import TaskGroup
    from transformers import PreTrainedTokenizerBase

    from coordinator.colocate import Colocation
    from coordinator.engines.client import EngineClient
    from coordinator.engines.fleet import EngineFleet
    from coordinator.engines.router import RouterHandle
    from coordinator.eval_fleet import EvalFleet
    from coordinator.health import FaultInjector, HealthMonitor
    from coordinator.loop import StepHook
    from coordinator.nodes.head import Head
    from coordinator.plan import PlacementPlan
    from coordinator.train.group import TrainGroup
    from coordinator.weight_sync import WeightSync

log = logging.getLogger("rayless")


class RunFailed(RaylessError, RuntimeError):
    """A failure a person can act on; printed without a traceback."""


def setup_logging(config: Config, run_dir: Path, *, log_name: str = "coordinator.log") -> None:
    """Log to `<run_dir>/<log_name>` and stderr, the run's secrets masked in every record."""
    run_dir.mkdir(parents=True, exist_ok=True)
    root = logging.getLogger()
    root.setLevel(config.logging.log_level)
    for handler in list(root.handlers):
        root.removeHandler(handler)
    file_handler = logging.FileHandler(run_dir / log_name)
    file_handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    handlers: list[logging.Handler] = [file_handler]
    if sys.stderr.isatty() and not config.logging.no_progress:
        from rich.logging import RichHandler

        handlers.append(RichHandler(console=stderr_console(), show_path=False, log_time_format="%H:%M:%S"))
    else:
        stream = logging.StreamHandler(sys.stderr)
        stream.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s", "%H:%M:%S"))
        handlers.append(stream)
    handlers[1].addFilter(ToFileOnly())  # the terminal: a user's traceback goes to the file alone
    mask = SecretMaskFilter(config_secrets(config))
    for handler in handlers:
        handler.addFilter(mask)
        root.addHandler(handler)
    for noisy in ("httpx", "httpcore", "aiohttp"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def run_training_sync(config: Config, plan: PlacementPlan | None = None) -> int:
    """`rayless train`'s exit status: 0, 1 after a failure (one line each when known), 128 + signal."""
    run_dir = config.logging.resolved_run_dir
    setup_logging(config, run_dir)
    write_resolved_config(config, run_dir)
    stopped_by: list[signal.Signals] = []
    failures: list[BaseException] = []
    try:
        anyio.run(run_until_signalled, lambda: run_training(config, plan=plan), stopped_by)
    except KeyboardInterrupt:  # a Ctrl-C in the instant before the signal receiver is up
        stopped_by.append(signal.SIGINT)
    except BaseExceptionGroup as group:
        failures = leaf_exceptions(group)
    except Exception as error:
        failures = [error]
    if stopped_by:
        for error in failures:  # raised while stopping: said, but the signal is why the run ended
            log.warning("while stopping: %s", failure_line(error))
        log.error("%s received; every launched process was stopped", stopped_by[0].name)
        return 128 + stopped_by[0]
    for error in failures:
        log_failure(log, error)
    return 1 if failures else 0


async def run_training(config: Config, *, plan: PlacementPlan | None = None,
                       extra_hooks: Callable[[Services], list[StepHook]] | None = None) -> dict[str, Any]:
    """Run the job; returns a summary (also written to <run_dir>/summary.json).

    `plan`: the placement plan computed at start-up (`rayless train` computes it before anything launches);
    computed here when not given. `extra_hooks(services)` returns more training-loop hooks
    (`after_step(rollout_id, weight_version)`); tests use it to act on the running services (kill a rank).
    """
    from coordinator.config.secrets import mask_text
    from coordinator.plan import describe_plan, plan_for_launch, where_text

    started = time.monotonic()
    run_dir = config.logging.resolved_run_dir
    plan = plan or plan_for_launch(config)
    secret_values = config_secrets(config)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "plan.txt").write_text(describe_plan(plan) + "\n")
    log.info("%s\n(full command lines and environments: %s)", describe_plan(plan, detail=False),
             run_dir / "plan.txt")
    metrics = MetricsLog(run_dir, tensorboard=config.logging.use_tensorboard, wandb=config.logging.use_wandb,
                         wandb_login=config.logging.wandb_login_kwargs(),
                         wandb_init=config.logging.wandb_init_kwargs(suffix=token_source.token_hex(3)))
    progress = ProgressDisplay(enabled=not config.logging.no_progress,
                               mask=lambda text: mask_text(text, secret_values))
    for slot in plan.local.processes():
        progress.board.expect(slot.name, where_text(slot))
    timings: dict[str, float] = {}
    if plan.weight_sync is not None and plan.weight_sync.snapshots.tmpfs:
        log.info("weight snapshots for the engines go to %s (%s)", plan.weight_sync.snapshots.directory,
                 plan.weight_sync.snapshots.why)
    try:
        # The HTTP client (in `resources`) closes only after every service's task has ended: an attached
        # router's workers are taken off it with that client as the run stops.
        async with AsyncExitStack() as resources, anyio.create_task_group() as task_group:
            await task_group.start(progress.run_view)
            services = await _start_services(config, plan, run_dir, task_group, resources, timings, progress)
            timings["services_ready_s"] = time.monotonic() - started
            with reporting_outcome(services.nodes):  # multi-node: the other nodes learn how the run ended
                summary = await _train(config, run_dir, services, metrics, progress, timings, task_group,
                                       extra_hooks, plan)
            if services.nodes is not None:
                summary["nodes"] = services.nodes.summary()
            task_group.cancel_scope.cancel()
    finally:
        metrics.close()
        if plan.weight_sync is not None:
            from coordinator.plan import remove_tmpfs_snapshots

            remove_tmpfs_snapshots(plan.weight_sync.snapshots)
    summary["wall_s"] = time.monotonic() - started
    summary.update(timings)
    plot = plot_rewards(metrics.history, run_dir / "rewards.png")
    if plot is not None:
        summary["plot"] = str(plot)
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    log.info("run finished in %.1fs; metrics in %s", summary["wall_s"], metrics.path)
    return summary


@dataclass
class Services:
    """What the run started, each piece present only where the mode needs it (None otherwise).

    Filled while the services start (concurrently) and as the loop is wired; read by the loop, the FT
    pieces and tests' hooks.
    """

    client: EngineClient | None = None
    fleet: EngineFleet | None = None
    router: RouterHandle | None = None
    train_group: TrainGroup | None = None
    tokenizer: PreTrainedTokenizerBase | None = None
    context_length: int | None = None
    eval_engines: EngineFleet | None = None  # the EngineFleet of group "eval"
    ft: FaultTolerance | None = None
    weight_sync: WeightSync | None = None
    colocation: Colocation | None = None  # the memory hand-over of a swapping run (--colocate)
    #: node 0 of a multi-node run: the token, the node registry and what the services take from them
    nodes: Head | None = None


async def _start_services(config: Config, plan: PlacementPlan, run_dir: Path, task_group: TaskGroup,
                          stack: AsyncExitStack, timings: dict[str, float], progress: ProgressDisplay) -> Services:
    services = Services()
    if plan.layout is not None:  # node 0 of several: the other nodes' processes report to its registry
        from coordinator.nodes.head import Head

        services.nodes = await Head.prepare(config, plan, run_dir)
    starters: list[Callable[[], Awaitable[None]]] = []
    if config.needs_engines:
        starters += await _engine_starters(config, plan, run_dir, task_group, stack, services, timings,
                                           progress)
    if config.needs_train_ranks:
        starters.append(_rank_starter(config, plan, run_dir, task_group, services, timings, progress))
    if services.nodes is not None:
        await services.nodes.start(task_group, lambda: services.train_group)
    if config.swaps_memory and services.fleet is not None and services.train_group is not None:
        from coordinator.colocate import Colocation

        services.colocation = Colocation(
            fleet=services.fleet, client=services.client, trainer=services.train_group, weight_sync=None,
            offload_train=config.offloads_train, offload_rollout=config.offloads_rollout,
            recovers_engines=config.rollout_ft_enabled, on_phase=progress.run.set_phase)
    async with anyio.create_task_group() as starting:
        for starter in starters:
            starting.start_soon(starter)
    if services.colocation is not None:
        t0 = time.monotonic()
        await services.colocation.settle_at_startup()
        timings["colocation_settled_s"] = time.monotonic() - t0
    return services


async def _engine_starters(config: Config, plan: PlacementPlan, run_dir: Path, task_group: TaskGroup,
                           stack: AsyncExitStack, services: Services, timings: dict[str, float],
                           progress: ProgressDisplay) -> list[Callable[[], Awaitable[None]]]:
    """Open the engine client and build the fleets from the plan's engine slots; return the tasks that start
    engines, router, tokenizer."""
    from coordinator.engines.client import EngineClient
    from coordinator.engines.fleet import EngineFleet

    t0 = time.monotonic()
    node, sglang, ft = plan.local, config.sglang, config.fault_tolerance
    client = services.client = await stack.enter_async_context(
        EngineClient(max_connections=min(config.generate_concurrency, 1024), api_key=sglang.sglang_api_key)
    )
    nodes = services.nodes
    fleet = services.fleet = EngineFleet(
        client=client, group="rollout", launch=[slot.spec for slot in node.rollout_engines],
        external_urls=plan.external_engines, run_dir=run_dir, probe_timeout=ft.rollout_health_check_timeout,
        observer=progress.board, **(nodes.fleet_kwargs("rollout") if nodes is not None else {}))
    if nodes is not None:
        nodes.watch(fleet)

    async def start_engines() -> None:
        await task_group.start(fleet.run)
        timings["engines_ready_s"] = time.monotonic() - t0
        router: RouterHandle | None = None
        if sglang.router_address is not None:  # attached: our engines join it, and leave it when the run ends
            from coordinator.engines.router import RouterHandle

            router = RouterHandle(client=client, run_dir=run_dir, policy=sglang.sglang_router_policy,
                                  address=sglang.router_address, observer=progress.board)
        elif node.router is not None:
            from coordinator.engines.router import RouterHandle

            slot = node.router
            router = RouterHandle(
                client=client, run_dir=run_dir, name="rollout", policy=slot.policy, host=slot.host,
                port=slot.port, prometheus_port=slot.prometheus_port, python=slot.python, observer=progress.board,
                extra_args=slot.extra_args)
        if router is not None:
            await task_group.start(router.run, [e.url for e in fleet.alive()])
            services.router = router
        if services.colocation is not None:
            await services.colocation.release_at_startup()  # the ranks load the model into the memory freed

    async def load_tokenizer() -> None:
        services.tokenizer, services.context_length = await anyio.to_thread.run_sync(_load_tokenizer, config)

    starters = [start_engines, load_tokenizer]
    if config.eval_fleet_enabled:
        # Dedicated eval engines: their own group and GPUs; never given training weights.
        eval_engines = services.eval_engines = EngineFleet(
            client=client, group="eval", launch=[slot.spec for slot in node.eval_engines], run_dir=run_dir,
            probe_timeout=ft.rollout_health_check_timeout, observer=progress.board,
            **(nodes.fleet_kwargs("eval") if nodes is not None else {}))
        if nodes is not None:
            nodes.watch(eval_engines)

        async def start_eval_engines() -> None:
            await task_group.start(eval_engines.run)
            timings["eval_engines_ready_s"] = time.monotonic() - t0

        starters.append(start_eval_engines)
    return starters


def _rank_starter(config: Config, plan: PlacementPlan, run_dir: Path, task_group: TaskGroup, services: Services,
                  timings: dict[str, float], progress: ProgressDisplay) -> Callable[[], Awaitable[None]]:
    from coordinator.train.group import TrainGroup

    t0 = time.monotonic()
    slot = plan.local.ranks
    assert slot is not None, "the plan places training ranks whenever the run trains"
    group = services.train_group = TrainGroup.from_spec(
        slot.spec, host=slot.control_host, port=slot.control_port, port_fixed=slot.control_port_fixed,
        extra_env=dict(slot.env), run_dir=run_dir, log_name=slot.log.name, observer=progress.board,
        **(services.nodes.rank_kwargs() if services.nodes is not None else {}))
    settings = config.rank_settings()

    async def start_ranks() -> None:
        await task_group.start(group.run)
        timings["ranks_ready_s"] = time.monotonic() - t0
        if services.colocation is not None:
            await services.colocation.startup_released.wait()
        await group.init(settings)
        timings["ranks_initialised_s"] = time.monotonic() - t0

    return start_ranks


def _load_tokenizer(config: Config) -> tuple[Any, int | None]:
    from transformers import AutoConfig, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(config.rollout.hf_checkpoint)
    model_config = AutoConfig.from_pretrained(config.rollout.hf_checkpoint)
    context = config.sglang.sglang_context_length or getattr(model_config, "max_position_embeddings", None)
    return tokenizer, context


async def _train(config: Config, run_dir: Path, services: Services, metrics: MetricsLog,
                 progress: ProgressDisplay, timings: dict[str, float], task_group: TaskGroup,
                 extra_hooks: Callable[[Services], list[StepHook]] | None = None,
                 plan: PlacementPlan | None = None) -> dict[str, Any]:
    from coordinator.loop import TrainingLoop
    from coordinator.rollout.manager import RolloutManager

    manager = RolloutManager.build(
        config, tokenizer=services.tokenizer, client=services.client, pool=services.fleet,
        router_url=services.router.url if services.router is not None else None,
        context_length=services.context_length, progress=progress,
    )
    from coordinator.hooks.service import start_hook_services

    await start_hook_services(manager, task_group=task_group, seed=config.rollout.rollout_seed,
                              router_url=services.router.url if services.router is not None else None,
                              api_key=config.sglang.sglang_api_key)
    weight_sync = services.weight_sync = build_weight_sync(config, services, run_dir, plan)
    if services.colocation is not None:
        services.colocation.weight_sync = weight_sync  # exports each step's snapshot before the ranks offload
    ft = services.ft = build_fault_tolerance(config, services=services, weight_sync=weight_sync,
                                             run_dir=run_dir, metrics=metrics)
    if ft.eval_fleet is not None:
        await task_group.start(ft.eval_fleet.run)
    for monitor in ft.monitors:
        await task_group.start(monitor.run)

    start_rollout = await _resume(config, services, manager, weight_sync)
    num_rollout = config.rollout.num_rollout
    if num_rollout is None:  # replay without --num-rollout: every dump the template finds
        ids = manager.replay_loader.available_rollout_ids()
        if not ids:
            raise RunFailed(f"--load-debug-rollout-data {config.debug.load_debug_rollout_data!r} matches no "
                            "dump file")
        num_rollout = max(ids) + 1
    hooks: list[StepHook] = [ft.eval_fleet] if ft.eval_fleet is not None else []
    rollout_eval = None
    if config.rollout_engine_eval_enabled:  # slime's default: evaluate on the rollout engines
        from coordinator.rollout_eval import RolloutEngineEval

        rollout_eval = RolloutEngineEval.from_run(config, manager, metrics)
        hooks.append(rollout_eval)
    if extra_hooks is not None:
        hooks += extra_hooks(services)
    rollouts: Any = manager
    if ft.injector is not None and ft.injector.armed:
        from coordinator.health import FaultInjectingSource

        rollouts = FaultInjectingSource(manager, ft.injector)
    loop = TrainingLoop(rollout=config.rollout, checkpoint=config.checkpoint, rollouts=rollouts,
                        trainer=services.train_group, weight_sync=weight_sync, metrics=metrics,
                        start_rollout=start_rollout, num_rollout=num_rollout, hooks=hooks, progress=progress.run,
                        colocation=services.colocation)
    timings["loop_start_s"] = 0.0
    if rollout_eval is not None:
        await rollout_eval.before_training(start_rollout, loop.weight_version)
    result = await loop.run()
    if ft.eval_fleet is not None:
        await ft.eval_fleet.drain(timeout=300)
    if config.checkpoint.save and services.train_group is not None and result.train_steps:
        await loop.save(num_rollout - 1)
    rewards = [row["rollout/reward_mean"] for row in metrics.history if "rollout/reward_mean" in row]
    return {
        "rollouts": result.rollouts,
        "train_steps": result.train_steps,
        "final_weight_version": loop.weight_version,
        "reward_first": rewards[:3],
        "reward_last": rewards[-3:],
        "train_recoveries": loop.train_recoveries,
        "ft": ft.summary(weight_sync),
        "rollout_engine_evals": rollout_eval.records if rollout_eval is not None else [],
        "colocation_engine_deaths": list(services.colocation.deaths) if services.colocation is not None else [],
    }


async def _resume(config: Config, services: Services, manager: Any, weight_sync: WeightSync | None) -> int:
    """With `--load` of a checkpoint: restore the ranks and the data order, push the restored weights; the first
    rollout id. A `--load` directory without a checkpoint yet starts fresh (slime's rule, `porting.resolve_load`)."""
    from coordinator.config.porting import resolve_load

    load = resolve_load(config).path
    if not load or services.train_group is None:
        return 0
    checkpoint = await services.train_group.load_checkpoint(Path(load))
    start_rollout = checkpoint.rollout_id + 1
    manager.load_state_dict(checkpoint.extra.get("rollout_state", {}))
    log.info("resumed from %s: continuing at rollout %d", load, start_rollout)
    if weight_sync is not None:
        await weight_sync.update(str(start_rollout))
    return start_rollout


def build_weight_sync(config: Config, services: Services, run_dir: Path,
                      plan: PlacementPlan | None = None) -> WeightSync | None:
    """WeightSync for the rollout engines; it recovers dead engines only with rollout FT (the config's gate).
    A distributed sync uses NCCL when the plan puts the ranks and every launched engine on CUDA (and no engine
    is attached from elsewhere, whose device is unknown), gloo otherwise."""
    if services.fleet is None or services.train_group is None or services.client is None:
        return None
    from coordinator.weight_sync import WeightSync

    sglang = config.sglang
    snapshot_dir = plan.weight_sync.snapshots.directory if plan is not None and plan.weight_sync is not None \
        else run_dir / "weights"
    return WeightSync(
        mode=sglang.update_weight_transfer_mode, fleet=services.fleet, client=services.client,
        trainer=services.train_group, snapshot_dir=snapshot_dir,
        keep_snapshots=config.checkpoint.keep_weight_snapshots, recover_engines=config.rollout_ft_enabled,
        router=services.router, bucket_bytes=sglang.update_weight_buffer_size,
        join_timeout_s=sglang.update_weight_join_timeout, backend=weight_backend(plan),
        pause_mode=sglang.pause_generation_mode,
        host=services.nodes.weight_host if services.nodes is not None else "127.0.0.1",
    )


def weight_backend(plan: PlacementPlan | None) -> str:
    node = plan.local if plan is not None else None
    if node is None or node.ranks is None or node.ranks.device != "cuda" or plan.external_engines:
        return "gloo"
    if plan.policy == "colocate":
        return "gloo"  # NCCL refuses two processes on one GPU (the plan refuses distributed sync there anyway)
    engines = node.rollout_engines
    return "nccl" if engines and all(slot.choice.on_gpu for slot in engines) else "gloo"


@dataclass
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


def build_fault_tolerance(config: Config, *, services: Services, weight_sync: WeightSync | None, run_dir: Path,
                          metrics: MetricsLog | None) -> FaultTolerance:
    """Monitors (rollout FT and engines only), the fault injector (always built when rollout engines exist, armed
    only by `config.fault_injection_armed`) and the eval fleet (probing itself unless a monitor watches it)."""
    ft = FaultTolerance()
    if services.fleet is None or services.client is None:
        return ft
    from coordinator.health import FaultInjector, build_health_monitors

    ft.injector = FaultInjector.from_config(config, services.fleet)
    if services.eval_engines is not None:
        from coordinator.eval_fleet import EvalFleet
        from coordinator.eval_settings import EvalSettings

        ft.eval_fleet = EvalFleet(
            settings=EvalSettings.from_slices(config.eval, rollout=config.rollout, sglang=config.sglang),
            fleet=services.eval_engines, client=services.client, tokenizer=services.tokenizer,
            exporter=services.train_group, snapshot_dir=run_dir / "eval_weights", metrics=metrics,
            probe_before_pin=not config.health_monitor_enabled,
        )
    ft.monitors = build_health_monitors(
        config.fault_tolerance, enabled=config.health_monitor_enabled, client=services.client,
        rollout_fleet=services.fleet, weight_sync=weight_sync, router=services.router,
        eval_fleet=services.eval_engines, eval_pauses=[ft.eval_fleet] if ft.eval_fleet is not None else [],
        rollout_pauses=[services.colocation] if services.colocation is not None else [],
    )
    return ft
