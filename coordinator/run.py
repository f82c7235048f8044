"""`rayless train`: wires the run's services in one anyio task group and runs the training loop.

Owns the wiring order and the run directory. Services start concurrently (engines, router, training ranks),
each through `task_group.start(service.run)`, so the loop begins only once everything it uses is ready;
leaving the block — normally, on error or on Ctrl-C — cancels the group, and each service ends the processes
it launched. Only what the mode needs is started: replay starts no engine, router, health monitor, eval fleet
or HTTP client; `--debug-rollout-only` starts no training ranks. Fault-tolerance pieces are built in
`build_fault_tolerance` from the config's derived gates only (health monitors, the fault injector, the eval
fleet's own probing), and `build_weight_sync` gives WeightSync its `recover_engines` gate.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import sys
import time
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio

from coordinator.config import Config, write_resolved_config
from coordinator.processes import leaf_exceptions

if sys.version_info < (3, 11):
    from exceptiongroup import BaseExceptionGroup
from coordinator.progress import MetricsLog, ProgressDisplay, plot_rewards

log = logging.getLogger("rayless")


class RunFailed(RuntimeError):
    """A failure a person can act on; printed without a traceback."""


def setup_logging(config: Config, run_dir: Path) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    root = logging.getLogger()
    root.setLevel(config.log_level)
    for handler in list(root.handlers):
        root.removeHandler(handler)
    file_handler = logging.FileHandler(run_dir / "coordinator.log")
    file_handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root.addHandler(file_handler)
    if sys.stderr.isatty() and not config.no_progress:
        from rich.logging import RichHandler

        root.addHandler(RichHandler(show_path=False, log_time_format="%H:%M:%S"))
    else:
        stream = logging.StreamHandler(sys.stderr)
        stream.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s", "%H:%M:%S"))
        root.addHandler(stream)
    for noisy in ("httpx", "httpcore", "aiohttp"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def run_training_sync(config: Config) -> int:
    run_dir = config.resolved_run_dir
    setup_logging(config, run_dir)
    write_resolved_config(config, run_dir)
    try:
        anyio.run(run_training, config)
    except KeyboardInterrupt:
        log.error("interrupted; every launched process was stopped")
        return 130
    except BaseExceptionGroup as group:
        errors = leaf_exceptions(group)
        for error in errors:
            log.error("run failed: %s", _describe(error), exc_info=_unexpected(error))
        return 1
    except Exception as error:
        log.error("run failed: %s", _describe(error), exc_info=_unexpected(error))
        return 1
    return 0


def _unexpected(error: BaseException) -> bool:
    """Known failure types are reported by message alone; anything else gets its traceback."""
    known = ("RunFailed", "RankFailure", "EngineLaunchError", "WeightSyncError", "NoEngineAvailable",
             "DumpError", "ReplayMissingError", "NotBuiltError", "RewardError", "DataSourceError", "HookLoadError",
             "RouterError", "EngineHTTPError", "EngineUnreachable")
    return type(error).__name__ not in known


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


async def run_training(config: Config, *, extra_hooks: Callable[[Services], list[Any]] | None = None
                       ) -> dict[str, Any]:
    """Run the job; returns a summary (also written to <run_dir>/summary.json).

    `extra_hooks(services)` returns more training-loop hooks (`after_step(rollout_id, weight_version)`); tests
    use it to act on the running services (kill a rank mid-run).
    """
    started = time.monotonic()
    run_dir = config.resolved_run_dir
    metrics = MetricsLog(run_dir, tensorboard=config.use_tensorboard, wandb=config.use_wandb)
    progress = ProgressDisplay(enabled=not config.no_progress)
    timings: dict[str, float] = {}
    try:
        async with AsyncExitStack() as stack:
            task_group = await stack.enter_async_context(anyio.create_task_group())
            services = await _start_services(config, run_dir, task_group, stack, timings)
            timings["services_ready_s"] = time.monotonic() - started
            summary = await _train(config, run_dir, services, metrics, progress, timings, task_group,
                                   extra_hooks)
            task_group.cancel_scope.cancel()
    finally:
        metrics.close()
    summary["wall_s"] = time.monotonic() - started
    summary.update(timings)
    plot = plot_rewards(metrics.history, run_dir / "rewards.png")
    if plot is not None:
        summary["plot"] = str(plot)
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    log.info("run finished in %.1fs; metrics in %s", summary["wall_s"], metrics.path)
    return summary


class Services:
    def __init__(self) -> None:
        self.client: Any = None
        self.fleet: Any = None
        self.router: Any = None
        self.train_group: Any = None
        self.tokenizer: Any = None
        self.context_length: int | None = None
        self.eval_engines: Any = None  # EngineFleet of group "eval"
        self.ft: FaultTolerance | None = None
        self.weight_sync: Any = None


async def _start_services(config: Config, run_dir: Path, task_group: Any, stack: AsyncExitStack,
                          timings: dict[str, float]) -> Services:
    services = Services()
    starters: list[Callable[[], Awaitable[None]]] = []
    t0 = time.monotonic()

    if config.needs_engines:
        from coordinator.engines.client import EngineClient
        from coordinator.engines.fleet import EngineFleet
        from coordinator.engines.launch import EngineLaunchSpec

        services.client = await stack.enter_async_context(
            EngineClient(max_connections=min(config.generate_concurrency, 1024), api_key=config.sglang_api_key)
        )
        cuda = _cuda_available()
        backend = config.resolved_engine_backend(cuda_available=cuda)
        extra: list[str] = ["--weight-version", "0"]
        if config.sglang_context_length:
            extra += ["--context-length", str(config.sglang_context_length)]
        if config.health_monitor_enabled:
            extra.append("--enable-metrics")  # the monitor tells slow from hung by /metrics progress
        if backend == "sglang":
            extra += ["--tp-size", str(config.rollout_num_gpus_per_engine), *config.sglang_passthrough]
        else:
            extra += ["--random-seed", str(config.rollout_seed),
                      "--max-running-requests", str(config.sglang_server_concurrency)]
        spec = EngineLaunchSpec(kind=backend, model_path=str(config.hf_checkpoint), api_key=config.sglang_api_key,
                                extra_args=tuple(extra))
        services.fleet = EngineFleet(client=services.client, group="rollout",
                                     launch=spec if config.num_launched_rollout_engines else None,
                                     num_engines=config.num_launched_rollout_engines,
                                     external_urls=config.rollout_external_engine_addrs, run_dir=run_dir,
                                     probe_timeout=config.rollout_health_check_timeout)

        async def start_engines() -> None:
            await task_group.start(services.fleet.run)
            timings["engines_ready_s"] = time.monotonic() - t0
            if config.use_sglang_router:
                from coordinator.engines.router import RouterHandle

                services.router = RouterHandle(client=services.client, run_dir=run_dir,
                                               policy=config.sglang_router_policy)
                await task_group.start(services.router.run, [e.url for e in services.fleet.alive()])

        if config.eval_fleet_enabled:
            # Dedicated eval engines: same launch spec, their own group; never given training weights.
            services.eval_engines = EngineFleet(client=services.client, group="eval", launch=spec,
                                                num_engines=config.num_eval_engines, run_dir=run_dir,
                                                probe_timeout=config.rollout_health_check_timeout)

            async def start_eval_engines() -> None:
                await task_group.start(services.eval_engines.run)
                timings["eval_engines_ready_s"] = time.monotonic() - t0

            starters.append(start_eval_engines)

        async def load_tokenizer() -> None:
            services.tokenizer, services.context_length = await anyio.to_thread.run_sync(
                _load_tokenizer, config)

        starters += [start_engines, load_tokenizer]

    if config.needs_train_ranks:
        from coordinator.train.group import TrainGroup

        services.train_group = TrainGroup(
            nproc_per_node=config.actor_num_gpus_per_node,
            nnodes=config.actor_num_nodes,
            node_rank=config.actor_node_rank,
            rdzv_endpoint=config.rdzv_endpoint,
            max_restarts=config.max_restarts if config.train_ft_enabled else 0,
            host=config.control_host,
            port=config.control_port,
            run_dir=run_dir,
        )

        async def start_ranks() -> None:
            await task_group.start(services.train_group.run)
            timings["ranks_ready_s"] = time.monotonic() - t0
            await services.train_group.init(train_settings(config))
            timings["ranks_initialised_s"] = time.monotonic() - t0

        starters.append(start_ranks)

    async with anyio.create_task_group() as starting:
        for starter in starters:
            starting.start_soon(starter)
    return services


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def _load_tokenizer(config: Config) -> tuple[Any, int | None]:
    from transformers import AutoConfig, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(config.hf_checkpoint)
    model_config = AutoConfig.from_pretrained(config.hf_checkpoint)
    context = config.sglang_context_length or getattr(model_config, "max_position_embeddings", None)
    return tokenizer, context


def train_settings(config: Config) -> dict[str, Any]:
    """What the ranks need to know, and nothing else: the ranks never see the coordinator's Config."""
    return {
        "model_path": str(config.hf_checkpoint),
        "seed": config.seed,
        "lr": config.lr,
        "warmup_steps": config.lr_warmup_iters,
        "weight_decay": config.weight_decay,
        "clip_grad": config.clip_grad,
        "eps_clip": config.eps_clip,
        "eps_clip_high": config.eps_clip_high if config.eps_clip_high is not None else config.eps_clip,
        "kl_coef": config.kl_coef,
        "use_kl_loss": config.use_kl_loss,
        "entropy_coef": config.entropy_coef,
        "max_tokens_per_micro_batch": config.max_tokens_per_gpu,
        "global_batch_size": config.global_batch_size,  # None: one optimizer step per rollout
        "save_dir": config.save,
    }


async def _train(config: Config, run_dir: Path, services: Services, metrics: MetricsLog,
                 progress: ProgressDisplay, timings: dict[str, float], task_group: Any,
                 extra_hooks: Callable[[Services], list[Any]] | None = None) -> dict[str, Any]:
    from coordinator.loop import TrainingLoop
    from coordinator.rollout.manager import RolloutManager

    manager = RolloutManager.build(
        config, tokenizer=services.tokenizer, client=services.client, pool=services.fleet,
        router_url=services.router.url if services.router is not None else None,
        context_length=services.context_length, progress=progress,
    )
    weight_sync = services.weight_sync = build_weight_sync(config, services, run_dir)
    ft = services.ft = build_fault_tolerance(config, services=services, weight_sync=weight_sync,
                                             run_dir=run_dir, metrics=metrics)
    if ft.eval_fleet is not None:
        await task_group.start(ft.eval_fleet.run)
    for monitor in ft.monitors:
        await task_group.start(monitor.run)

    start_rollout = 0
    if config.load and services.train_group is not None:
        checkpoint = await services.train_group.load_checkpoint(Path(config.load))
        start_rollout = checkpoint.rollout_id + 1
        manager.load_state_dict(checkpoint.extra.get("rollout_state", {}))
        log.info("resumed from %s: continuing at rollout %d", config.load, start_rollout)
        if weight_sync is not None:
            await weight_sync.update(str(start_rollout))

    num_rollout = config.num_rollout
    if num_rollout is None:  # replay without --num-rollout: every dump the template finds
        ids = manager.replay_loader.available_rollout_ids()
        if not ids:
            raise RunFailed(f"--load-debug-rollout-data {config.load_debug_rollout_data!r} matches no dump file")
        num_rollout = max(ids) + 1
    hooks: list[Any] = [ft.eval_fleet] if ft.eval_fleet is not None else []
    if extra_hooks is not None:
        hooks += extra_hooks(services)
    rollouts: Any = manager
    if ft.injector is not None and ft.injector.armed:
        from coordinator.health import FaultInjectingSource

        rollouts = FaultInjectingSource(manager, ft.injector)
    loop = TrainingLoop(config=config, rollouts=rollouts, trainer=services.train_group, weight_sync=weight_sync,
                        metrics=metrics, start_rollout=start_rollout, num_rollout=num_rollout, hooks=hooks)
    timings["loop_start_s"] = 0.0
    result = await loop.run()
    if ft.eval_fleet is not None:
        await ft.eval_fleet.drain(timeout=300)
    if config.save and services.train_group is not None and result.train_steps:
        await loop.save(num_rollout - 1)
    rewards = [row.get("rollout/reward_mean") for row in result.history if "rollout/reward_mean" in row]
    return {
        "rollouts": result.rollouts,
        "train_steps": result.train_steps,
        "final_weight_version": loop.weight_version,
        "reward_first": rewards[:3],
        "reward_last": rewards[-3:],
        "train_recoveries": loop.train_recoveries,
        "ft": ft.summary(weight_sync),
    }


def build_weight_sync(config: Config, services: Services, run_dir: Path) -> Any:
    """WeightSync for the rollout engines; it recovers dead engines only with rollout FT (the config's gate)."""
    if services.fleet is None or services.train_group is None:
        return None
    from coordinator.weight_sync import WeightSync

    return WeightSync(
        mode=config.update_weight_transfer_mode, fleet=services.fleet, client=services.client,
        trainer=services.train_group, snapshot_dir=run_dir / "weights",
        keep_snapshots=config.keep_weight_snapshots, recover_engines=config.rollout_ft_enabled,
        router=services.router,
    )


@dataclass
class FaultTolerance:
    """The FT pieces of one run, each present only where its gate in Config says so."""

    monitors: list[Any] = field(default_factory=list)
    injector: Any = None
    eval_fleet: Any = None

    def summary(self, weight_sync: Any) -> dict[str, Any]:
        return {
            "monitors": [m.group for m in self.monitors],
            "monitor_stats": {m.group: dataclasses.asdict(m.stats) for m in self.monitors},
            "injection_armed": bool(self.injector is not None and self.injector.armed),
            "injected": list(self.injector.killed) if self.injector is not None else [],
            "weight_sync_recoveries": getattr(weight_sync, "recoveries", 0),
            "eval_probes": self.eval_fleet.probes if self.eval_fleet is not None else 0,
            "evals": [dataclasses.asdict(r) for r in self.eval_fleet.records] if self.eval_fleet is not None
            else [],
        }


def build_fault_tolerance(config: Config, *, services: Services, weight_sync: Any, run_dir: Path,
                          metrics: MetricsLog | None) -> FaultTolerance:
    """Monitors (rollout FT and engines only), the fault injector (always built when rollout engines exist, armed
    only by `config.fault_injection_armed`) and the eval fleet (probing itself unless a monitor watches it)."""
    ft = FaultTolerance()
    if services.fleet is None:
        return ft
    from coordinator.health import FaultInjector, build_health_monitors

    ft.injector = FaultInjector.from_config(config, services.fleet)
    if services.eval_engines is not None:
        from coordinator.eval_fleet import EvalFleet
        from coordinator.eval_settings import EvalSettings

        ft.eval_fleet = EvalFleet(
            settings=EvalSettings.from_config(config), fleet=services.eval_engines, client=services.client,
            tokenizer=services.tokenizer, exporter=services.train_group, snapshot_dir=run_dir / "eval_weights",
            metrics=metrics, probe_before_pin=not config.health_monitor_enabled,
        )
    ft.monitors = build_health_monitors(
        config, client=services.client, rollout_fleet=services.fleet, weight_sync=weight_sync,
        router=services.router, eval_fleet=services.eval_engines,
        eval_pauses=[ft.eval_fleet] if ft.eval_fleet is not None else [],
    )
    return ft
