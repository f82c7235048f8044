"""EvalFleet: dedicated eval engines, pinned to one weight snapshot per evaluation, running beside training.

Owns the eval engine group's contents (which snapshot it serves), the queue of evaluations and their records.
The engines belong to an `EngineFleet` of group "eval"; pinning is `coordinator.eval.pin`'s, the flags and
datasets `coordinator.eval.settings`'. Flow, and why not the rollout engines: docs/evaluation.md.

Invariants:
- Eval engines never receive training weight updates: only `pin()` loads weights into them; WeightSync never
  sees this fleet.
- An evaluation runs on every eval engine, or is skipped (`unhealthy`, `pin_violation`), unless
  `EvalSettings.allow_partial_fleet`; every sample it keeps reports the pinned version.
- Evaluations never block training: `after_step` only exports and queues; at most `--eval-max-in-flight` are
  admitted (the oldest waiting one is skipped as `busy`); a running one is never aborted.
- Every evaluation ends in exactly one record (done, or skipped with its reason), also in the metrics file.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import anyio
import anyio.abc

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

#: Eval prompts are not clipped to a context length (their budget is --eval-max-response-len).
_UNBOUNDED_CONTEXT = 1 << 30
#: how long the end of a run waits for evaluations still in flight before the final save
DRAIN_TIMEOUT_S = 300.0


class WeightExporter(Protocol):
    async def export_weights(self, directory: Path, weight_version: str, keep: int = 2) -> Path: ...


@dataclass
class EvalJob:
    eval_id: int
    pinned_step: int
    weight_version: str
    snapshot: str
    queued_at: float = field(default_factory=time.monotonic)


@dataclass
class EvalRecord:
    eval_id: int
    pinned_step: int
    weight_version: str
    status: str  # "done" | "skipped"
    reason: str | None = None
    detail: str = ""
    metrics: dict[str, float] = field(default_factory=dict)
    lag_steps: int = 0
    duration_s: float = 0.0


class EvalFleet:
    """Start with `await task_group.start(eval_fleet.run)`; the training loop calls `after_step` as a hook.

    Args:
        settings: the eval flags (`EvalSettings.from_slices`; `probe_before_pin` is derived by the caller).
        fleet: the EngineFleet of group "eval".
        client: the shared engine client.
        tokenizer: the policy's tokenizer (prompts are sent as token ids).
        exporter: has `export_weights(directory, version, keep)` (the TrainGroup); None without training
            (`--debug-rollout-only`): the `--hf-checkpoint` directory is pinned as version "0" then.
        snapshot_dir: where eval snapshots go (`<run_dir>/eval_weights`).
        metrics: the run's MetricsLog (None: records only).
        probe_before_pin: True when no HealthMonitor watches the eval engines.
        datasets: the eval datasets (None: loaded from `settings`).
        pin_wait: seconds `pin()` waits for dead engines to come back before skipping (or, with
            `settings.allow_partial_fleet`, going on with the alive ones).
        timeout: bound on each engine call during a pin (load, version, 1-token generate).
    """

    def __init__(
        self,
        *,
        settings: EvalSettings,
        fleet: EngineFleet,
        client: EngineClient,
        tokenizer: Any,
        exporter: WeightExporter | None,
        snapshot_dir: Path,
        metrics: MetricsLog | None = None,
        probe_before_pin: bool,
        datasets: Sequence[EvalDataset] | None = None,
        pin_wait: float = 60.0,
        timeout: float = 120.0,
    ) -> None:
        self.settings = settings
        self.fleet = fleet
        self.client = client
        self.tokenizer = tokenizer
        self.exporter = exporter
        self.snapshot_dir = Path(snapshot_dir)
        self.metrics = metrics
        self.datasets = list(datasets) if datasets is not None else load_eval_datasets(settings, tokenizer)
        self.pin_wait = pin_wait
        self.interval = settings.interval
        self.max_in_flight = settings.max_in_flight
        concurrency = max(1, settings.server_concurrency * len(fleet.engines))
        slots = RequestSlots(concurrency)  # datasets run one after another: one bound for all of them
        self.generate_states: dict[str, GenerateState] = {
            dataset.name: generate_state(dataset, tokenizer=tokenizer, context_length=_UNBOUNDED_CONTEXT,
                                         concurrency=concurrency, request_slots=slots)
            for dataset in self.datasets
        }
        self.pinning = EvalPin(fleet=fleet, client=client, probe_before_pin=probe_before_pin,
                               pin_wait=pin_wait, timeout=timeout, allow_partial=settings.allow_partial_fleet)
        self.records: list[EvalRecord] = []
        self.latest_step = -1
        self._next_id = 0
        self._waiting: collections.deque[EvalJob] = collections.deque()
        self._running: EvalJob | None = None
        self._changed = anyio.Event()

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
        return await self.pinning.pin(checkpoint_dir, weight_version)

    @property
    def updating(self) -> anyio.Event:
        """Set while no pin loads weights: the eval group's HealthMonitor pauses on it."""
        return self.pinning.updating

    @property
    def probes(self) -> int:
        """Engine probes made by the pins themselves (0 whenever a monitor watches the engines)."""
        return self.pinning.probes

    @property
    def probe_before_pin(self) -> bool:
        return self.pinning.probe_before_pin

    async def before_loop(self, start_rollout: int, weight_version: str) -> None:
        """Evaluations start from step hooks only."""

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
        return self.interval is not None and (rollout_id + 1) % self.interval == 0

    async def after_step(self, rollout_id: int, weight_version: str) -> None:
        """Training-loop hook: export the current weights and queue an evaluation when one is due."""
        self.latest_step = rollout_id
        if not self.due(rollout_id):
            return
        if self.exporter is not None:
            # keep: every admitted evaluation's snapshot, plus this one
            path = await self.exporter.export_weights(self.snapshot_dir, weight_version,
                                                      keep=self.max_in_flight + 1)
            snapshot = str(path)
        else:
            snapshot = self.settings.hf_checkpoint
        self.submit(rollout_id, weight_version, snapshot)

    def submit(self, pinned_step: int, weight_version: str, snapshot: str) -> EvalJob:
        job = EvalJob(self._next_id, pinned_step, str(weight_version), snapshot)
        self._next_id += 1
        admitted = len(self._waiting) + (self._running is not None)
        if admitted >= self.max_in_flight:
            if self._waiting:
                self._record_skip(self._waiting.popleft(), EvalSkip("busy", "a newer evaluation was queued"))
            else:
                self._record_skip(job, EvalSkip("busy", "the eval fleet is busy with an earlier evaluation"))
                return job
        self._waiting.append(job)
        self._notify()
        return job

    # -- one evaluation ------------------------------------------------------------------------------

    async def _run_job(self, job: EvalJob) -> None:
        started = time.monotonic()
        try:
            pinned = await self.pin(job.snapshot, job.weight_version)
            per_dataset = await self._evaluate(job, pinned)
        except EvalSkip as skip:
            self._record_skip(job, skip, duration=time.monotonic() - started)
            return
        except Exception as error:  # an eval must never end the run: its engines failed under it
            log.warning("eval %d failed", job.eval_id, exc_info=True)
            self._record_skip(job, EvalSkip("unhealthy", f"evaluation failed: {error!r}"[:500]),
                              duration=time.monotonic() - started)
            return
        duration = time.monotonic() - started
        lag = max(0, self.latest_step - job.pinned_step)
        flat: dict[str, Any] = {"eval/weight_version": job.weight_version, "eval/pinned_step": job.pinned_step,
                                "eval/lag_steps": lag, "eval/duration_s": duration,
                                "eval/engines": len(pinned), "eval/engines_total": len(self.fleet.engines)}
        for name, values in per_dataset.items():
            flat.update(values)
            flat.update({f"eval/{name}/pinned_step": float(job.pinned_step), f"eval/{name}/lag_steps": float(lag),
                         f"eval/{name}/duration_s": duration})
        record = EvalRecord(job.eval_id, job.pinned_step, job.weight_version, "done", metrics=flat,
                            lag_steps=lag, duration_s=duration)
        self.records.append(record)
        if self.metrics is not None:
            self.metrics.log(job.pinned_step, flat)
        log.info("eval %d of step %d (weights %s): %s", job.eval_id, job.pinned_step, job.weight_version,
                 "  ".join(f"{name} reward {v[f'eval/{name}']:.3f}" for name, v in per_dataset.items()))

    def _record_skip(self, job: EvalJob, skip: EvalSkip, duration: float = 0.0) -> None:
        log.warning("eval %d of step %d skipped: %s", job.eval_id, job.pinned_step, skip)
        self.records.append(EvalRecord(job.eval_id, job.pinned_step, job.weight_version, "skipped",
                                       reason=skip.reason, detail=skip.detail, duration_s=duration))
        if self.metrics is not None:
            self.metrics.log(job.pinned_step, {"eval/skipped": 1.0, "eval/skip_reason": skip.reason,
                                               "eval/weight_version": job.weight_version})

    # -- generate and score --------------------------------------------------------------------------

    async def _evaluate(self, job: EvalJob, pinned: dict[str, int]) -> dict[str, dict[str, float]]:
        """Generate and score every dataset on the pinned engines (`eval_run`, the eval id in place of the
        rollout id in the sampling seeds)."""
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
