"""EvalFleet: dedicated eval engines, pinned to one weight snapshot per evaluation, running beside training
(miles' `--eval-num-gpus` fleet with its `EvalDispatcher`; `--eval-num-engines` on CPU).

Owns the eval engine group's contents (which snapshot it serves), the queue of evaluations, their snapshots on
disk and their records. The engines belong to an `EngineFleet` of group "eval"; pinning is
`coordinator.eval.pin`'s, the flags and datasets `coordinator.eval.settings`'. Flow, and why not the rollout
engines: docs/evaluation.md.

Invariants:
- Eval engines never receive training weight updates: only `pin()` loads weights into them; WeightSync never
  sees this fleet. With an `evaluator` (miles' `CheckpointEvalFn`) there are no engines: each evaluation hands
  its snapshot directory to the evaluator, and everything below holds the same.
- An evaluation runs on every eval engine, or is skipped (`unhealthy`, `pin_violation`), unless
  `EvalSettings.allow_partial_fleet`; every sample it keeps reports the pinned version.
- Each evaluation's snapshot is `<snapshot_dir>/step_<rollout_id>` (miles' `--eval-hf-dir` layout); every
  settled evaluation retires exactly one snapshot it exported, and at most `--eval-keep-snapshots` settled
  ones stay on disk; a directory it did not export (`--hf-checkpoint`, a `--save-hf` checkpoint) is never
  deleted.
- At most `--eval-max-in-flight` evaluations are pending (running or waiting). One more due waits for the
  oldest to settle (`backpressure`) or is skipped as `busy` (`skip`); the run's final evaluation is never
  skipped. A running evaluation is never aborted.
- Every evaluation ends in exactly one record (done, or skipped with its reason), also in the metrics file
  (`eval/skipped_<reason>` at its step, as miles logs it).
"""

from __future__ import annotations

import collections
import logging
import os
import shutil
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import anyio
import anyio.abc

from coordinator.config.checkpoint import save_hf_path
from coordinator.engines.client import EngineClient
from coordinator.engines.fleet import EngineFleet
from coordinator.eval.pin import EvalPin, EvalSkip, PinnedPool
from coordinator.eval.run import evaluate_dataset, generate_state
from coordinator.eval.settings import EvalDataset, EvalSettings, load_eval_datasets
from coordinator.observe.timeline import span
from coordinator.rollout.dispatch import Dispatcher
from coordinator.rollout.requests import GenerateState, RequestSlots

if TYPE_CHECKING:
    from coordinator.observe.progress import MetricsLog

log = logging.getLogger(__name__)

#: Without --eval-max-context-len / --rollout-max-context-len, eval prompts are not clipped to a context length
#: (their budget is --eval-max-response-len).
_UNBOUNDED_CONTEXT = 1 << 30
#: how long the end of a run waits for evaluations still in flight before the final save
DRAIN_TIMEOUT_S = 300.0


class WeightExporter(Protocol):
    async def export_weights(self, directory: Path, weight_version: str, keep: int = 2) -> Path: ...


#: A snapshot backend (miles' `CheckpointEvalFn` behind `--eval-function-path`): (pinned step, weight version,
#: snapshot directory) -> the evaluation's metrics row; raises a hook's `EvalSkip(reason)` to skip the point.
SnapshotEvaluator = Callable[[int, str, str], Awaitable[dict[str, Any]]]


@dataclass
class EvalJob:
    eval_id: int
    pinned_step: int
    weight_version: str
    snapshot: str
    exported: bool = False  # the fleet wrote `snapshot` and retires it once the evaluation settles
    queued_at: float = field(default_factory=time.monotonic)


@dataclass
class EvalRecord:
    eval_id: int
    pinned_step: int
    weight_version: str
    status: str  # "done" | "skipped"
    reason: str | None = None
    snapshot: str = ""  # the directory pinned ("" when skipped before one was chosen)
    detail: str = ""
    metrics: dict[str, float] = field(default_factory=dict)
    lag_steps: int = 0
    duration_s: float = 0.0


class EvalFleet:
    """Start with `await task_group.start(eval_fleet.run)`; the training loop calls `after_step` as a hook.

    Args:
        settings: the eval flags (`EvalSettings.from_slices`; `probe_before_pin` is derived by the caller).
        fleet: the EngineFleet of group "eval"; None with `evaluator`, which has no engines of ours.
        client: the shared engine client.
        tokenizer: the policy's tokenizer (prompts are sent as token ids).
        exporter: has `export_weights(directory, version, keep)` (`TrainGroup.commands`); None without training
            (`--debug-rollout-only`): the `--hf-checkpoint` directory is pinned as version "0" then.
        snapshot_dir: where eval snapshots go (`--eval-hf-dir`, else `<run_dir>/eval_weights`).
        metrics: the run's MetricsLog (None: records only).
        probe_before_pin: True when no HealthMonitor watches the eval engines.
        datasets: the eval datasets (None: loaded from `settings`).
        pin_wait: seconds `pin()` waits for dead engines to come back before skipping (or, with
            `settings.allow_partial_fleet`, going on with the alive ones).
        timeout: bound on each engine call during a pin (load, version, 1-token generate).
        evaluator: miles' `CheckpointEvalFn` posture: each evaluation hands the snapshot directory to it
            instead of pinning engines; the rest (exports, in-flight bound, retiring, records) is the same.
    """

    def __init__(
        self,
        *,
        settings: EvalSettings,
        fleet: EngineFleet | None,
        client: EngineClient | None,
        tokenizer: Any,
        exporter: WeightExporter | None,
        snapshot_dir: Path,
        metrics: MetricsLog | None = None,
        probe_before_pin: bool,
        datasets: Sequence[EvalDataset] | None = None,
        pin_wait: float = 60.0,
        timeout: float = 120.0,
        evaluator: SnapshotEvaluator | None = None,
    ) -> None:
        if (fleet is None) == (evaluator is None):
            raise ValueError("an EvalFleet pins its engines (fleet) or hands snapshots to an evaluator: one")
        self.settings = settings
        self.fleet = fleet
        self.client = client
        self.tokenizer = tokenizer
        self.exporter = exporter
        self.snapshot_dir = Path(snapshot_dir)
        self.metrics = metrics
        self.evaluator = evaluator
        if datasets is None:
            datasets = load_eval_datasets(settings, tokenizer) if fleet is not None else ()
        self.datasets = list(datasets)
        self.pin_wait = pin_wait
        self.interval = settings.interval
        self.max_in_flight = settings.max_in_flight
        concurrency = max(1, settings.server_concurrency * (len(fleet.engines) if fleet is not None else 1))
        slots = RequestSlots(concurrency)  # datasets run one after another: one bound for all of them
        self.generate_states: dict[str, GenerateState] = {
            dataset.name: generate_state(dataset, tokenizer=tokenizer,
                                         context_length=settings.max_context_len or _UNBOUNDED_CONTEXT,
                                         concurrency=concurrency, request_slots=slots)
            for dataset in self.datasets
        }
        self.pinning = EvalPin(fleet=fleet, client=client, probe_before_pin=probe_before_pin, pin_wait=pin_wait,
                               timeout=timeout, allow_partial=settings.allow_partial_fleet) \
            if fleet is not None and client is not None else None
        self.records: list[EvalRecord] = []
        self.latest_step = -1
        self._next_id = 0
        self._waiting: collections.deque[EvalJob] = collections.deque()
        self._running: EvalJob | None = None
        self._changed = anyio.Event()
        self._retired: list[Path] = []  # exported snapshots of settled evaluations, oldest first

    # -- lifetime ------------------------------------------------------------------------------------

    async def run(self, *, task_status: anyio.abc.TaskStatus[EvalFleet] = anyio.TASK_STATUS_IGNORED) -> None:
        """Run queued evaluations one at a time until cancelled."""
        task_status.started(self)
        while True:
            while not self._waiting:
                await self._wait_changed()
            job = self._waiting.popleft()
            self._running = job
            try:
                with span("eval", ("eval", "eval fleet"), eval_id=job.eval_id, pinned_step=job.pinned_step):
                    await self._run_job(job)
            finally:
                self._running = None
                with anyio.CancelScope(shield=True):
                    await self._retire(job)
                self._notify()

    @property
    def waiting(self) -> tuple[EvalJob, ...]:
        """Admitted evaluations not started yet, oldest first."""
        return tuple(self._waiting)

    @property
    def running(self) -> EvalJob | None:
        """The evaluation running now, if any."""
        return self._running

    # -- pinning (EvalPin) ---------------------------------------------------------------------------

    async def pin(self, checkpoint_dir: str, weight_version: str) -> dict[str, int]:
        """Make the eval engines serve `checkpoint_dir` as `weight_version` (`EvalPin.pin`)."""
        assert self.pinning is not None, "an evaluator's EvalFleet pins no engines"
        return await self.pinning.pin(checkpoint_dir, weight_version)

    @property
    def updating(self) -> anyio.Event:
        """Set while no pin loads weights: the eval group's HealthMonitor pauses on it."""
        assert self.pinning is not None, "an evaluator's EvalFleet has no engines to monitor"
        return self.pinning.updating

    @property
    def probes(self) -> int:
        """Engine probes made by the pins themselves (0 whenever a monitor watches the engines)."""
        return self.pinning.probes if self.pinning is not None else 0

    @property
    def probe_before_pin(self) -> bool:
        return self.pinning is not None and self.pinning.probe_before_pin

    async def before_loop(self, start_rollout: int, weight_version: str) -> None:
        """miles' train_async: a run starting at rollout 0 first evaluates `--hf-checkpoint` itself (step 0, never
        exported nor deleted), unless `--skip-eval-before-train`."""
        if start_rollout == 0 and self.interval is not None and not self.settings.skip_before_train:
            await self.dispatch(0, weight_version, snapshot=self.settings.hf_checkpoint)

    async def after_loop(self) -> None:
        """The training loop's last phase before the final save: the run's last evaluation gets recorded."""
        await self.drain(timeout=DRAIN_TIMEOUT_S)

    async def drain(self, timeout: float) -> None:
        """Wait (up to `timeout`) for admitted evaluations to finish: the run's last eval gets recorded."""
        with anyio.move_on_after(timeout):
            while self._waiting or self._running is not None:
                await self._wait_changed()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()

    async def _wait_changed(self) -> None:
        await self._changed.wait()

    # -- scheduling ------------------------------------------------------------------------------------

    def due(self, rollout_id: int) -> bool:
        """Every `--eval-interval`-th rollout, and the last one (miles' `should_run_periodic_action`)."""
        if self.interval is None:
            return False
        return (rollout_id + 1) % self.interval == 0 or self.is_final(rollout_id)

    def is_final(self, rollout_id: int) -> bool:
        return self.settings.num_rollout is not None and rollout_id == self.settings.num_rollout - 1

    @property
    def pending(self) -> int:
        """Evaluations admitted and not settled: running or waiting."""
        return len(self._waiting) + (self._running is not None)

    async def after_step(self, rollout_id: int, weight_version: str) -> None:
        """Training-loop hook: when an evaluation is due, export the current weights and queue it."""
        self.latest_step = rollout_id
        if self.due(rollout_id):
            await self.dispatch(rollout_id, weight_version, final=self.is_final(rollout_id))

    async def dispatch(self, step: int, weight_version: str, *, final: bool = False,
                       snapshot: str | None = None) -> EvalJob | None:
        """miles' `EvalDispatcher.dispatch`: over `--eval-max-in-flight`, skip as `busy` (`skip`, unless `final`)
        or wait for the oldest pending evaluation to settle (`backpressure`); then export (unless `snapshot`
        names an existing directory, which is never deleted) and queue. None when the evaluation was skipped
        before it was queued (`busy`, `export_failed`)."""
        if self.pending >= self.max_in_flight:
            if self.settings.overflow_policy == "skip" and not final:
                self._record_skip(EvalJob(self._take_id(), step, str(weight_version), ""),
                                  EvalSkip("busy", f"{self.pending} evaluation(s) pending, --eval-max-in-flight "
                                                   f"{self.max_in_flight}"))
                return None
            while self.pending >= self.max_in_flight:  # backpressure: training waits for the oldest to settle
                await self._wait_changed()
        if snapshot is not None:
            return self.submit(step, weight_version, snapshot)
        try:
            snapshot, exported = await self._snapshot(step, weight_version)
        except EvalSkip as skip:
            self._record_skip(EvalJob(self._take_id(), step, str(weight_version), ""), skip)
            return None
        return self.submit(step, weight_version, snapshot, exported=exported)

    def submit(self, pinned_step: int, weight_version: str, snapshot: str, *, exported: bool = False) -> EvalJob:
        """Queue an evaluation of `snapshot` (no bound: `dispatch` applies it)."""
        job = EvalJob(self._take_id(), pinned_step, str(weight_version), snapshot, exported=exported)
        self._waiting.append(job)
        self._notify()
        return job

    def _take_id(self) -> int:
        self._next_id += 1
        return self._next_id - 1

    # -- snapshots -------------------------------------------------------------------------------------

    def snapshot_path(self, step: int) -> Path:
        """miles' layout: `{eval_hf_dir}/step_{rollout_id}`."""
        return self.snapshot_dir / f"step_{step}"

    async def _snapshot(self, step: int, weight_version: str) -> tuple[str, bool]:
        """(the directory to pin, whether this fleet exported it). Without training (`exporter` None) the
        `--hf-checkpoint` directory is pinned. Raises EvalSkip("export_failed"), the partial directory removed."""
        if self.exporter is None:
            return self.settings.hf_checkpoint, False
        if self.settings.hf_dir is None and self.settings.save_hf is not None:
            # miles: without --eval-hf-dir the --save-hf checkpoint of this step is pinned (never deleted); one not
            # written (yet) at this step (the final save comes after the loop) is exported as without --save-hf
            saved = Path(save_hf_path(self.settings.save_hf, step))
            if await anyio.to_thread.run_sync(lambda: (saved / "config.json").is_file()):
                return str(saved), False
        target = self.snapshot_path(step)
        started = time.monotonic()
        try:
            # rank 0 writes <snapshot_dir>/weights-<version> (no other weights-* lives here, keep=1 prunes
            # nothing else); renamed to miles' name in the same directory
            written = await self.exporter.export_weights(self.snapshot_dir, weight_version, keep=1)
            await anyio.to_thread.run_sync(_move_into_place, Path(written), target)
        except Exception as error:  # a failed export skips one evaluation, never the run
            log.warning("eval snapshot of step %d failed", step, exc_info=True)
            await anyio.to_thread.run_sync(lambda: shutil.rmtree(target, ignore_errors=True))
            raise EvalSkip("export_failed", f"export to {target} failed: {error!r}"[:500]) from None
        log.info("eval snapshot of step %d written to %s in %.1fs", step, target, time.monotonic() - started)
        return str(target), True

    async def _retire(self, job: EvalJob) -> None:
        """Every settled evaluation retires exactly one snapshot, whatever its outcome (miles' `_retire`)."""
        if not job.exported:
            return
        self._retired.append(Path(job.snapshot))
        victims = []
        while len(self._retired) > self.settings.keep_snapshots:
            victims.append(self._retired.pop(0))
        for victim in victims:
            await anyio.to_thread.run_sync(lambda path=victim: shutil.rmtree(path, ignore_errors=True))
            log.info("removed settled eval snapshot %s", victim)

    # -- one evaluation ------------------------------------------------------------------------------

    async def _run_job(self, job: EvalJob) -> None:
        started = time.monotonic()
        try:
            if self.evaluator is not None:
                row = await self.evaluator(job.pinned_step, job.weight_version, job.snapshot)
                self._record_done(job, row, time.monotonic() - started)
                return
            pinned = await self.pin(job.snapshot, job.weight_version)
            per_dataset = await self._evaluate(job, pinned)
        except EvalSkip as skip:
            self._record_skip(job, skip, duration=time.monotonic() - started)
            return
        except Exception as error:  # an eval must never end the run (miles: the point is skipped as crashed)
            if (reason := _hook_skip_reason(error)) is not None:  # the backend's EvalSkip(reason)
                self._record_skip(job, EvalSkip(reason, str(error)[:500], backend=True),
                                  duration=time.monotonic() - started)
                return
            log.warning("eval %d failed", job.eval_id, exc_info=True)
            self._record_skip(job, EvalSkip("crashed", f"evaluation failed: {error!r}"[:500]),
                              duration=time.monotonic() - started)
            return
        duration = time.monotonic() - started
        lag = max(0, self.latest_step - job.pinned_step)
        assert self.fleet is not None
        flat: dict[str, Any] = {"eval/weight_version": job.weight_version, "eval/pinned_step": job.pinned_step,
                                "eval/lag_steps": lag, "eval/duration_s": duration,
                                "eval/engines": len(pinned), "eval/engines_total": len(self.fleet.engines)}
        for name, values in per_dataset.items():
            flat.update(values)
            flat.update({f"eval/{name}/pinned_step": float(job.pinned_step), f"eval/{name}/lag_steps": float(lag),
                         f"eval/{name}/duration_s": duration})
        record = EvalRecord(job.eval_id, job.pinned_step, job.weight_version, "done", metrics=flat,
                            lag_steps=lag, duration_s=duration, snapshot=job.snapshot)
        self.records.append(record)
        if self.metrics is not None:
            self.metrics.log(job.pinned_step, flat)
        log.info("eval %d of step %d (weights %s): %s", job.eval_id, job.pinned_step, job.weight_version,
                 "  ".join(f"{name} reward {v[f'eval/{name}']:.3f}" for name, v in per_dataset.items()))

    def _record_done(self, job: EvalJob, row: dict[str, Any], duration: float) -> None:
        """An evaluator's evaluation: its metrics row with miles' `eval/lag_steps`, `eval/duration_seconds`."""
        lag = max(0, self.latest_step - job.pinned_step)
        flat = {**row, "eval/weight_version": job.weight_version, "eval/pinned_step": job.pinned_step,
                "eval/lag_steps": lag, "eval/duration_s": duration}
        self.records.append(EvalRecord(job.eval_id, job.pinned_step, job.weight_version, "done", metrics=flat,
                                       lag_steps=lag, duration_s=duration, snapshot=job.snapshot))
        if self.metrics is not None:
            self.metrics.log(job.pinned_step, flat)
        log.info("eval %d of step %d (snapshot %s) done", job.eval_id, job.pinned_step, job.snapshot)

    def _record_skip(self, job: EvalJob, skip: EvalSkip, duration: float = 0.0) -> None:
        log.warning("eval %d of step %d skipped: %s", job.eval_id, job.pinned_step, skip)
        self.records.append(EvalRecord(job.eval_id, job.pinned_step, job.weight_version, "skipped",
                                       reason=skip.reason, detail=skip.detail, duration_s=duration,
                                       snapshot=job.snapshot))
        if self.metrics is not None:
            self.metrics.log(job.pinned_step, {"eval/skipped": 1.0, f"eval/skipped_{skip.reason}": 1.0,
                                               "eval/skip_reason": skip.reason,
                                               "eval/weight_version": job.weight_version})

    # -- generate and score --------------------------------------------------------------------------

    async def _evaluate(self, job: EvalJob, pinned: dict[str, int]) -> dict[str, dict[str, float]]:
        """Generate and score every dataset on the pinned engines (`eval_run`, the eval id in place of the
        rollout id in the sampling seeds)."""
        assert self.client is not None and self.fleet is not None
        dispatcher = Dispatcher(client=self.client, pool=PinnedPool(self.fleet, pinned),
                                engine_wait=self.pin_wait)
        results: dict[str, dict[str, float]] = {}
        for dataset in self.datasets:
            groups, metrics = await evaluate_dataset(dataset, self.generate_states[dataset.name], dispatcher,
                                                     job.eval_id)
            wrong = {s.metadata["engine"]: s.weight_versions[0] for g in groups for s in g
                     if s.weight_versions != [job.weight_version]}
            if wrong:
                raise EvalSkip("pin_violation", f"samples answered with weight versions {wrong}, pinned "
                                                f"{job.weight_version!r}")
            results[dataset.name] = metrics
        return results


def _hook_skip_reason(error: BaseException) -> str | None:
    """The reason of a backend's `EvalSkip(reason)` (ours, `coordinator.hooks.EvalSkip`, or miles' own), made a
    metric-name part (`eval/skipped_<reason>`); None for any other exception."""
    reason = getattr(error, "reason", None)
    if type(error).__name__ != "EvalSkip" or not isinstance(reason, str):
        return None
    return "".join(c if c.isalnum() or c == "_" else "_" for c in reason.strip())[:64] or "skipped"


def _move_into_place(written: Path, target: Path) -> None:
    """Rename the exported directory to `target` (replacing one left by an earlier attempt at this step)."""
    if written == target:
        return
    if target.exists():
        shutil.rmtree(target)
    os.replace(written, target)
