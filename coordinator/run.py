"""`rayless train`: the run's task group, its services and the training loop, in one order.

Owns the run directory (plan.txt, config.json, summary.json) and the order of a run: the placement plan
(computed once at start-up), the services built complete and started (`coordinator.services`), the rollout
manager and the hook services, then the training loop. Leaving the task group — normally, on error or on a
stop signal — cancels it, and each service ends the processes it launched; the exit status after a signal is
128 + the signal (`coordinator.lifecycle.signals`). While the loop runs with `--save`, the first stop signal goes
to the loop (finish the step in flight, save, return: `coordinator.loop`); otherwise it cancels the run. How the
run ended — finished, interrupted or failed — goes to status.json and summary.json, and a run that did not
finish prints the command that resumes it (`coordinator.lifecycle.resume`). Only what the mode needs is built: replay starts no engine,
router, health monitor, eval fleet or HTTP client; `--debug-rollout-only` starts no training ranks. The order
and why: docs/architecture.md ("How a run is wired").
"""

from __future__ import annotations

import dataclasses
import json
import logging
import secrets as token_source
import signal
import sys
import time
from collections.abc import Callable, Sequence
from contextlib import AsyncExitStack, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio

from coordinator.config import Config, write_resolved_config
from coordinator.config.secrets import config_secrets
from coordinator.hooks.calls import HookBounds, hook_bounds
from coordinator.lifecycle.failures import failure_line, log_failure
from coordinator.lifecycle.logs import setup_logging
from coordinator.lifecycle.model_out import model_hint
from coordinator.lifecycle.processes import leaf_exceptions
from coordinator.lifecycle.resume import resume_hint
from coordinator.lifecycle.signals import StopSignals, run_until_signalled
from coordinator.nodes.head import reporting_outcome
from coordinator.observe.progress import MetricsLog, ProgressDisplay, plot_rewards
from coordinator.observe.rank_watch import RankCallWatch
from coordinator.observe.stacks import disable as disable_stacks
from coordinator.observe.stacks import enable as enable_stacks
from coordinator.observe.timeline import recording
from coordinator.observe.watchdog import LoopWatchdog
from workers.errors import RaylessError

if sys.version_info < (3, 11):
    from exceptiongroup import BaseExceptionGroup

from coordinator.services import (
    Services,
    StartupClock,
    build_fault_tolerance,
    build_processes,
    start_processes,
)
from coordinator.status.service import RunStatus

if TYPE_CHECKING:
    from anyio.abc import TaskGroup

    from coordinator.loop import LoopPhase, StepHook
    from coordinator.plan import PlacementPlan
    from coordinator.train.channel import ControlServer

log = logging.getLogger("rayless")

#: How long the ranks' torchrun may take to exit after a run that ended by itself told them to shut down.
CLEAN_EXIT_S = 60.0


class RunFailed(RaylessError, RuntimeError):
    """A failure a person can act on; printed without a traceback."""


def run_training_sync(config: Config, plan: PlacementPlan | None = None,
                      argv: Sequence[str] | None = None) -> int:
    """`rayless train`'s exit status: 0, 1 after a failure (one line each when known), 128 + signal. `argv`:
    the command's arguments, for the command that resumes a run that did not finish."""
    run_dir = config.logging.resolved_run_dir
    cleared: list[str] = []
    if config.logging.overwrite_run_dir:  # checked at start-up; done here, as the run starts
        from coordinator.checks.run_dir import clear_run_dir

        cleared = clear_run_dir(run_dir, save=config.checkpoint.save)
    setup_logging(config, run_dir)
    if cleared:
        log.info("--overwrite-run-dir: removed the earlier run's %s", ", ".join(cleared))
    write_resolved_config(config, run_dir)
    stop = StopSignals()
    failures: list[BaseException] = []
    try:
        anyio.run(run_until_signalled, lambda: run_training(config, plan=plan, stop=stop), stop)
    except KeyboardInterrupt:  # a Ctrl-C in the instant before the signal receiver is up
        stop.received.append(signal.SIGINT)
    except BaseExceptionGroup as group:
        failures = leaf_exceptions(group)
    except Exception as error:
        failures = [error]
    hint = None
    if argv is not None and (stop.received or failures):  # how to go on from the newest checkpoint, if any
        hint = resume_hint(config, argv, stopped=bool(stop.received))
    if stop.first is not None:
        for error in failures:  # raised while stopping: said, but the signal is why the run ended
            log.warning("while stopping: %s", failure_line(error))
        # a stop a person asked for: not an error
        log.info("%s received; every launched process was stopped", stop.first.name)
        if hint:
            log.info("%s", hint)
        return 128 + stop.first
    for error in failures:
        log_failure(log, error)
    if hint:
        log.info("%s", hint)
    if failures and all(getattr(error, "exit_status", 1) == 2 for error in failures):
        return 2  # input refused (a checkpoint a train-FT recovery was to load), as at start-up
    return 1 if failures else 0


async def run_training(config: Config, *, plan: PlacementPlan | None = None,
                       extra_hooks: Callable[[Services], list[StepHook]] | None = None,
                       stop: StopSignals | None = None) -> dict[str, Any]:
    """Run the job; returns a summary (also written to <run_dir>/summary.json).

    `plan`: the placement plan of the resolved `config` (`rayless train` resolves both before anything
    launches: `coordinator.checks.resolve`); without one, `config` is resolved here (its checks aside). `extra_hooks(services)` returns more training-loop hooks
    (`after_step(rollout_id, weight_version)`); tests use it to act on the running services (kill a rank).
    `stop`: the run's stop signals (`run_until_signalled`'s), whose first one the loop handles while it saves.
    """
    from coordinator.config.secrets import mask_text
    from coordinator.plan import describe_plan, where_text

    clock = StartupClock()
    stop = stop or StopSignals()
    outcome = "failed"
    if plan is None:  # the layout, the rollout count, the plan: as `rayless train` resolves them
        from coordinator.checks.resolve import resolve

        resolved = resolve(config, checks=False)
        config, plan = resolved.config, resolved.plan
        assert plan is not None
    run_dir = config.logging.resolved_run_dir
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
    status = RunStatus(config, run_dir, progress=progress, metrics=metrics,
                       mask=lambda text: mask_text(text, secret_values))
    if plan.weight_sync is not None and plan.weight_sync.snapshots.tmpfs:
        log.info("weight snapshots for the engines go to %s (%s)", plan.weight_sync.snapshots.directory,
                 plan.weight_sync.snapshots.why)
    try:
        # The HTTP client (in `resources`) closes only after every service's task has ended: an attached
        # router's workers are taken off it with that client as the run stops.
        async with AsyncExitStack() as resources, anyio.create_task_group() as task_group:
            resources.enter_context(recording(status.timeline))  # every task started from here records to it
            resources.enter_context(hook_bounds(HookBounds(  # every hook call from here runs within these
                limits=config.hooks.hook_limits(), max_in_a_row=config.hooks.hook_max_failures_in_a_row)))
            await task_group.start(progress.run_view)
            # `rayless stacks RUN_DIR`: every child started from here registers its stack dump in run_dir/stacks
            resources.callback(disable_stacks)
            stacks_dir = enable_stacks(run_dir)
            watchdog = LoopWatchdog(config.logging.loop_stall_warn_s, stacks_dir=stacks_dir)
            await task_group.start(watchdog.run)
            status.sources.loop = watchdog.stats
            metrics.row_sources.append(lambda: {"perf/loop_lag_max_s": watchdog.stats.take_window_max()})
            services = await _start_services(config, plan, run_dir, task_group, resources, clock, progress,
                                             metrics)
            await status.start(services, task_group)
            if services.train_group is not None:
                await task_group.start(rank_call_watch(services.train_group.server, config, stacks_dir).run)
            clock.mark("services_ready_s")
            with reporting_outcome(services.nodes):  # multi-node: the other nodes learn how the run ended
                summary = await _train(config, services, metrics, progress, clock, task_group, extra_hooks,
                                       stop)
                outcome = "interrupted" if summary["stopped"] else "finished"
                if services.train_group is not None and not summary["stopped"]:
                    # A run that ended by itself lets torchrun finish its clean exit (seconds on a loaded machine);
                    # a cancelled one (a signal, a failure) keeps the group's short grace and its 10 s bound.
                    await services.train_group.finish(within=CLEAN_EXIT_S)
            if services.nodes is not None:
                summary["nodes"] = services.nodes.summary()
            task_group.cancel_scope.cancel()
    except BaseException:
        outcome = "interrupted" if stop.received else "failed"
        raise
    finally:
        status.finish(outcome)
        metrics.close()
        if plan.weight_sync is not None:
            from coordinator.plan import remove_tmpfs_snapshots

            remove_tmpfs_snapshots(plan.weight_sync.snapshots)
    summary["outcome"] = outcome
    summary["wall_s"] = time.monotonic() - clock.started
    summary.update(clock.marks)
    plot = plot_rewards(metrics.history, run_dir / "rewards.png")
    if plot is not None:
        summary["plot"] = str(plot)
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    log.info("run %s in %.1fs; metrics in %s", outcome, summary["wall_s"], metrics.path)
    hint = model_hint(config, summary.get("saved", []))
    if hint is not None:
        log.info("%s", hint)
    return summary


def rank_call_watch(server: ControlServer, config: Config, stacks_dir: Path) -> RankCallWatch:
    """Names the ranks a command waits on past its bound (`--rank-call-warn-s`), with every process's stacks, and
    ends the wait at its deadline (`--rank-call-timeout-s`)."""

    def rank_pid(rank: int) -> int | None:
        info = server.ranks.get(rank)
        return info.pid if info is not None else None

    return RankCallWatch(in_flight=lambda: server.in_flight, longest_s=lambda kind: server.longest_s.get(kind, 0.0),
                         rank_pid=rank_pid, floor_s=config.logging.rank_call_warn_s, stacks_dir=stacks_dir,
                         deadline_floor_s=config.logging.rank_call_timeout_s, kill_overdue=config.train_ft_enabled)


async def _start_services(config: Config, plan: PlacementPlan, run_dir: Path, task_group: TaskGroup,
                          resources: AsyncExitStack, clock: StartupClock, progress: ProgressDisplay,
                          metrics: MetricsLog) -> Services:
    """Build every service the mode needs, then start them (`coordinator.services`)."""
    nodes = None
    if plan.layout is not None:  # node 0 of several: the other nodes' processes report to its registry
        from coordinator.nodes.head import Head

        nodes = await Head.prepare(config, plan, run_dir)
    client = None
    if config.needs_engines:
        from coordinator.engines.client import EngineClient

        client = await resources.enter_async_context(EngineClient(
            max_connections=min(config.generate_concurrency, 1024), api_key=config.sglang.sglang_api_key,
            admin_api_key=config.sglang.sglang_admin_api_key,
            stall_timeout=config.fault_tolerance.engine_stall_timeout_s,
            token_timeout=config.fault_tolerance.engine_token_timeout_s))
        await task_group.start(client.watch_stalls)  # the head-liveness rule (coordinator/engines/stall.py)
    processes = build_processes(config, plan, run_dir, client=client, nodes=nodes, progress=progress)
    tokenizer, context_length = await start_processes(config, processes, task_group, clock)
    ft = build_fault_tolerance(config, processes, tokenizer=tokenizer, run_dir=run_dir, metrics=metrics)
    if ft.eval_fleet is not None:
        await task_group.start(ft.eval_fleet.run)
    for monitor in ft.monitors:
        await task_group.start(monitor.run)
    return Services(**{f.name: getattr(processes, f.name) for f in dataclasses.fields(processes)},
                    tokenizer=tokenizer, context_length=context_length, ft=ft)


async def _train(config: Config, services: Services, metrics: MetricsLog, progress: ProgressDisplay,
                 clock: StartupClock, task_group: TaskGroup,
                 extra_hooks: Callable[[Services], list[StepHook]] | None, stop: StopSignals) -> dict[str, Any]:
    from coordinator.loop import TrainingLoop
    from coordinator.rollout.hook_services import start_hook_services
    from coordinator.rollout.manager import RolloutManager
    from workers.collector import tune_collector

    router_url = services.router.url if services.router is not None else None
    teachers = services.teacher_engines  # --opd-teacher-load of --opd-type sglang: the teacher rayless serves
    manager = RolloutManager.build(
        config, tokenizer=services.tokenizer, client=services.client, pool=services.fleet, router_url=router_url,
        context_length=services.context_length, progress=progress,
        teacher_urls={"default": teachers.alive()[0].url} if teachers is not None else None,
    )
    await start_hook_services(manager, task_group=task_group, seed=config.rollout.rollout_seed,
                              router_url=router_url, api_key=config.sglang.sglang_api_key)
    tune_collector()  # start-up's heap out of the collector's passes, fewer of them (issue 38)
    if config.hooks.use_session_server is not None and config.needs_engines:
        from coordinator.sessions.service import start_session_server  # miles' session server for agents

        await start_session_server(manager, task_group=task_group, api_key=config.sglang.sglang_api_key)
    ft = services.ft
    num_rollout = config.rollout.num_rollout
    assert num_rollout is not None, "resolve() decides the rollout count (coordinator.rollout.epochs)"
    hooks: list[StepHook] = []
    phases: list[LoopPhase] = []
    if ft.eval_fleet is not None:
        hooks.append(ft.eval_fleet)
        phases.append(ft.eval_fleet)
    rollout_eval = None
    checkpoint_eval = await _start_checkpoint_eval(config, services, manager, metrics, task_group)
    if checkpoint_eval is not None:  # miles' CheckpointEvalFn: snapshots handed to the user's backend
        hooks.append(checkpoint_eval)
        phases.append(checkpoint_eval)
    elif config.rollout_engine_eval_enabled:  # slime's default: evaluate on the rollout engines
        from coordinator.eval.rollout_engines import RolloutEngineEval

        rollout_eval = RolloutEngineEval.from_run(config, manager, metrics)
        hooks.append(rollout_eval)
        phases.append(rollout_eval)
    if extra_hooks is not None:
        hooks += extra_hooks(services)
    rollouts: Any = manager
    if ft.injector is not None and ft.injector.armed:
        from coordinator.engines.health import FaultInjectingSource

        rollouts = FaultInjectingSource(manager, ft.injector)
    loop = TrainingLoop(rollout=config.rollout, checkpoint=config.checkpoint, rollouts=rollouts,
                        trainer=services.train_group.commands if services.train_group is not None else None,
                        weight_sync=services.weight_sync, metrics=metrics,
                        num_rollout=num_rollout, resume_from=_resume_path(config), hooks=hooks, phases=phases,
                        progress=progress.run, colocation=services.colocation)
    clock.mark("loop_start_s")
    # with --save, a stop signal ends the loop cleanly (the step in flight, a save); otherwise it cancels the run
    with stop.handled_by(loop.request_stop) if loop.saves else nullcontext():
        try:
            result = await loop.run()
        finally:
            if checkpoint_eval is not None:  # miles' RolloutManager.dispose(): the backend's own teardown
                await anyio.to_thread.run_sync(manager.eval_fn.dispose)
    # metrics.history: every rollout of the run, those of earlier runs it resumed included
    rewards = [row["rollout/reward_mean"] for row in metrics.history if "rollout/reward_mean" in row]
    return {
        "stopped": result.stopped,
        "start_rollout": result.start_rollout,
        "checkpoint": str(result.checkpoint) if result.checkpoint is not None else None,
        "saved": list(result.saved),
        "rollouts": result.rollouts,
        "train_steps": result.train_steps,
        "final_weight_version": loop.weight_version,
        "reward_first": rewards[:3],
        "reward_last": rewards[-3:],
        "train_recoveries": loop.train_recoveries,
        "ft": ft.summary(services.weight_sync),
        "rollout_engine_evals": rollout_eval.records if rollout_eval is not None else [],
        "checkpoint_evals": [dataclasses.asdict(r) for r in checkpoint_eval.records] if checkpoint_eval else [],
        "colocation_engine_deaths": list(services.colocation.deaths) if services.colocation is not None else [],
    }


async def _start_checkpoint_eval(config: Config, services: Services, manager: Any, metrics: MetricsLog,
                                 task_group: TaskGroup) -> Any:
    """miles' `CheckpointEvalFn` behind `--eval-function-path`: the eval dispatcher (`EvalFleet`) with the
    function as its evaluator, started on `task_group`; None for any other eval function."""
    if not (config.builds_rollout_fn and config.rollout.eval_function_path is not None
            and config.eval.eval_interval is not None):
        return None
    eval_fn = manager.eval_fn
    if not getattr(eval_fn, "evaluates_snapshots", False):
        return None
    from coordinator.eval.fleet import EvalFleet
    from coordinator.eval.settings import EvalSettings
    from coordinator.rollout.slime_rollout_fn import eval_metrics

    async def evaluate(step: int, weight_version: str, snapshot: str) -> dict[str, Any]:
        return eval_metrics(await eval_fn.evaluate_snapshot(step, weight_version, snapshot))

    run_dir = config.logging.resolved_run_dir
    fleet = EvalFleet(
        settings=EvalSettings.from_slices(config.eval, rollout=config.rollout, sglang=config.sglang,
                                          save_hf=config.checkpoint.save_hf),
        fleet=None, client=None, tokenizer=services.tokenizer,
        exporter=services.train_group.commands if services.train_group is not None else None,
        snapshot_dir=Path(config.eval.eval_hf_dir) if config.eval.eval_hf_dir else run_dir / "eval_weights",
        metrics=metrics, probe_before_pin=False, datasets=(), evaluator=evaluate)
    await task_group.start(fleet.run)
    return fleet


def _resume_path(config: Config) -> Path | None:
    """The checkpoint `--load` names, or None. A `--load` directory without a checkpoint yet starts fresh
    (slime's rule, `config.checkpoint.resolve_load`)."""
    load = config.load_plan().path
    return Path(load) if load else None
