"""EvalFleet: dedicated eval engines, pinned to one weight snapshot per evaluation, running beside training.

Owns the eval engine group's *contents* (which snapshot it serves), the queue of evaluations and their records.
The engines themselves (processes, states) belong to an `EngineFleet` of group "eval"; when rollout FT is on a
HealthMonitor of that group probes and recovers them, otherwise `pin()` probes and recovers them itself.

Flow: after every `--eval-interval`-th training step the loop's hook exports the current weights to
`<run_dir>/eval_weights/weights-<version>` (separate from the rollout snapshots, which are pruned on their own
schedule) and queues an evaluation; the fleet's task runs them one at a time (the engines can serve only one
snapshot at a time). Each evaluation pins (`pin(snapshot, version)`), then generates
`--n-samples-per-eval-prompt` samples per prompt of every `--eval-prompt-data NAME PATH` dataset on the pinned
engines and scores them with the run's reward rules.

Why not the manager's eval fn: `RolloutManager.eval_fn` is bound to the rollout engines' dispatcher and the
rollout prompt source; an eval on those engines would be aborted and re-weighted by training updates. The eval
fleet therefore runs its own small generate over the eval datasets, with the same reward model rules
(`rm_type` of a `builtin:` task, else `--rm-type` / `--custom-rm-path`).

Invariants:
- Eval engines never receive training weight updates: only `pin()` loads weights into them, and only the
  snapshot of the evaluation being run; WeightSync never sees this fleet.
- `pin()` returns only when every engine it pinned reports the pinned version and answered a 1-token
  generate; otherwise it raises `EvalSkip("unhealthy" | "pin_violation")`. Every sample an evaluation keeps
  reports the pinned version (a mismatch is a `pin_violation` skip, never a silent metric).
- `pin()` probes the engines itself exactly when no monitor watches them (`probe_before_pin`, from
  `Config.health_monitor_enabled`), and leaves probing and recovery to the monitor otherwise.
- Evaluations never block training: `after_step` only exports and queues. At most `--eval-max-in-flight`
  evaluations are admitted (running or waiting); over the bound the oldest waiting one is skipped with reason
  `busy` (when none waits, the new one is). A running evaluation is never aborted by training.
- Every evaluation ends in exactly one record (done or skipped with its reason), also written to the run's
  metrics file with the `eval/` prefix.
"""

from __future__ import annotations

import collections
import logging
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import anyio.abc

from coordinator.engines.client import NO_RETRY, EngineClient, EngineError
from coordinator.engines.fleet import EngineFleet, EngineHandle, EngineState
from coordinator.rollout.data_source import PromptRecord, read_prompt_file
from coordinator.rollout.dispatch import Dispatcher
from coordinator.rollout.rewards import RewardModel
from replay.sample import Sample, SampleStatus

log = logging.getLogger(__name__)

BUILTIN_EVAL_PROMPTS = 32
_FINISH = {"stop": SampleStatus.COMPLETED, "length": SampleStatus.TRUNCATED, "abort": SampleStatus.ABORTED}


class EvalSkip(Exception):
    """An evaluation that did not run. `reason`: "unhealthy", "pin_violation" or "busy"."""

    REASONS = ("unhealthy", "pin_violation", "busy")

    def __init__(self, reason: str, detail: str = "") -> None:
        if reason not in self.REASONS:
            raise ValueError(f"EvalSkip reason must be one of {self.REASONS}, got {reason!r}")
        super().__init__(f"eval skipped ({reason}){': ' + detail if detail else ''}")
        self.reason = reason
        self.detail = detail


@dataclass
class EvalDataset:
    name: str
    records: list[PromptRecord]
    reward_model: RewardModel


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


class _PinnedPool:
    """The engines one evaluation may use: those pinned by it, in the incarnation that was pinned (a
    relaunched engine serves the base weights until the next pin, so it is not used)."""

    def __init__(self, fleet: EngineFleet, pinned: dict[str, int]) -> None:
        self.fleet = fleet
        self.pinned = pinned

    def alive(self) -> list[EngineHandle]:
        return [h for h in self.fleet.alive() if self.pinned.get(h.name) == h.incarnation]

    async def check(self, handle: EngineHandle) -> bool:
        return await self.fleet.check(handle)

    async def wait_any_alive(self, timeout: float) -> list[EngineHandle]:
        with anyio.fail_after(timeout):
            while not (alive := self.alive()):
                await self.fleet.wait_changed()
        return alive

    def mark_dead(self, handle: EngineHandle, reason: str) -> None:
        self.fleet.mark_dead(handle, reason)

    async def wait_changed(self) -> None:
        await self.fleet.wait_changed()


class EvalFleet:
    """Start with `await task_group.start(eval_fleet.run)`; the training loop calls `after_step` as a hook.

    Args:
        config: the run's Config (eval flags; `probe_before_pin` is derived by the caller from it).
        fleet: the EngineFleet of group "eval".
        client: the shared engine client.
        tokenizer: the policy's tokenizer (prompts are sent as token ids).
        exporter: has `export_weights(directory, version, keep)` (the TrainGroup); None without training
            (`--debug-rollout-only`): the `--hf-checkpoint` directory is pinned as version "0" then.
        snapshot_dir: where eval snapshots go (`<run_dir>/eval_weights`).
        metrics: the run's MetricsLog (None: records only).
        probe_before_pin: True when no HealthMonitor watches the eval engines.
        pin_wait: seconds `pin()` waits for dead engines to come back before going on with the alive ones.
        timeout: bound on each engine call during a pin (load, version, 1-token generate).
    """

    def __init__(
        self,
        *,
        config: Any,
        fleet: EngineFleet,
        client: EngineClient,
        tokenizer: Any,
        exporter: Any,
        snapshot_dir: Path,
        metrics: Any = None,
        probe_before_pin: bool,
        datasets: Sequence[EvalDataset] | None = None,
        pin_wait: float = 60.0,
        timeout: float = 120.0,
    ) -> None:
        self.config = config
        self.fleet = fleet
        self.client = client
        self.tokenizer = tokenizer
        self.exporter = exporter
        self.snapshot_dir = Path(snapshot_dir)
        self.metrics = metrics
        self.probe_before_pin = probe_before_pin
        self.datasets = list(datasets) if datasets is not None else load_eval_datasets(config)
        self.pin_wait = pin_wait
        self.timeout = timeout
        self.interval = config.eval_interval
        self.max_in_flight = config.eval_max_in_flight
        self.n_samples = config.n_samples_per_eval_prompt
        self.sampling = {
            "temperature": config.eval_temperature if config.eval_temperature is not None
            else config.rollout_temperature,
            "top_p": config.eval_top_p if config.eval_top_p is not None else config.rollout_top_p,
            "max_new_tokens": config.eval_max_response_len or config.rollout_max_response_len,
        }
        self.concurrency = max(1, config.sglang_server_concurrency * len(fleet.engines))
        # Pausing protocol for the eval group's HealthMonitor: set = not pinning.
        self.updating = anyio.Event()
        self.updating.set()
        self.records: list[EvalRecord] = []
        self.probes = 0  # engine probes made by pin() itself (0 whenever a monitor watches the engines)
        self.pins = 0
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
                await self._run_job(job)
            finally:
                self._running = None
                self._notify()

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
            snapshot = str(self.config.hf_checkpoint)
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
                                "eval/lag_steps": lag, "eval/duration_s": duration}
        for name, values in per_dataset.items():
            values.update({"pinned_step": float(job.pinned_step), "lag_steps": float(lag), "duration_s": duration})
            flat.update({f"eval/{name}/{key}": value for key, value in values.items()})
        record = EvalRecord(job.eval_id, job.pinned_step, job.weight_version, "done", metrics=flat,
                            lag_steps=lag, duration_s=duration)
        self.records.append(record)
        if self.metrics is not None:
            self.metrics.log(job.pinned_step, flat)
        log.info("eval %d of step %d (weights %s): %s", job.eval_id, job.pinned_step, job.weight_version,
                 "  ".join(f"{name} reward {v['reward_mean']:.3f} pass@{self.n_samples} {v['pass_at_k']:.3f}"
                           for name, v in per_dataset.items()))

    def _record_skip(self, job: EvalJob, skip: EvalSkip, duration: float = 0.0) -> None:
        log.warning("eval %d of step %d skipped: %s", job.eval_id, job.pinned_step, skip)
        self.records.append(EvalRecord(job.eval_id, job.pinned_step, job.weight_version, "skipped",
                                       reason=skip.reason, detail=skip.detail, duration_s=duration))
        if self.metrics is not None:
            self.metrics.log(job.pinned_step, {"eval/skipped": 1.0, "eval/skip_reason": skip.reason,
                                               "eval/weight_version": job.weight_version})

    # -- pinning -------------------------------------------------------------------------------------

    async def pin(self, checkpoint_dir: str, weight_version: str) -> dict[str, int]:
        """Make the eval engines serve `checkpoint_dir` as `weight_version`; returns {engine: incarnation}.

        Raises EvalSkip("unhealthy") when no engine is alive (after probing/recovering) or one does not answer
        a 1-token generate, EvalSkip("pin_violation") when an engine does not report the version after a
        second load.
        """
        self.pins += 1
        if self.probe_before_pin:
            await self._probe_and_recover()
        alive = await self._wait_alive()
        self.updating = anyio.Event()  # the eval group's monitor (if any) must not probe a loading engine
        try:
            await self._load(alive, checkpoint_dir, weight_version)
            await self._one_token(alive)
        finally:
            self.updating.set()
        return {h.name: h.incarnation for h in alive}

    async def _probe_and_recover(self) -> None:
        async def probe(handle: EngineHandle) -> None:
            if handle.state is not EngineState.ALIVE:
                return
            self.probes += 1
            if not await self.fleet.check(handle):
                self.fleet.mark_dead(handle, "eval fleet probe before pinning failed")

        async def recover(handle: EngineHandle) -> None:
            try:
                await self.fleet.relaunch(handle, timeout=self.pin_wait)
            except Exception as error:  # the pin goes on with the others; none alive → unhealthy
                log.warning("eval engine %s could not be recovered: %r", handle.name, error)

        async with anyio.create_task_group() as tg:
            for handle in self.fleet.engines:
                tg.start_soon(probe, handle)
        async with anyio.create_task_group() as tg:
            for handle in self.fleet.engines:
                if handle.state is EngineState.DEAD:
                    tg.start_soon(recover, handle)

    async def _wait_alive(self) -> list[EngineHandle]:
        """Every engine alive, or after `pin_wait` the alive ones; none → unhealthy."""
        with anyio.move_on_after(0 if self.probe_before_pin else self.pin_wait):
            while len(self.fleet.alive()) < len(self.fleet.engines):
                await self.fleet.wait_changed()
        alive = self.fleet.alive()
        if not alive:
            states = {h.name: h.dead_reason or h.state.value for h in self.fleet.engines}
            raise EvalSkip("unhealthy", f"no eval engine is alive: {states}")
        return alive

    async def _load(self, engines: list[EngineHandle], checkpoint_dir: str, version: str) -> None:
        async def load(handle: EngineHandle) -> None:
            api = self.client.engine(handle.url)
            with anyio.fail_after(self.timeout):
                await api.update_weights_from_disk(checkpoint_dir, weight_version=version, flush_cache=True,
                                                   timeout=self.timeout)

        async def version_of(handle: EngineHandle) -> str:
            with anyio.fail_after(self.timeout):
                return await self.client.engine(handle.url).get_weight_version(timeout=self.timeout)

        wrong = await self._for_each(engines, load, version_of, version)
        if wrong:
            log.warning("eval engines %s do not report version %s after the load; loading once more", wrong, version)
            wrong = await self._for_each([h for h in engines if h.name in wrong], load, version_of, version)
        if wrong:
            raise EvalSkip("pin_violation", f"engines report {wrong} instead of weight version {version!r}")

    async def _for_each(self, engines: list[EngineHandle], load: Any, version_of: Any, version: str) -> dict[str, str]:
        wrong: dict[str, str] = {}

        async def one(handle: EngineHandle) -> None:
            try:
                await load(handle)
                got = await version_of(handle)
            except (EngineError, TimeoutError) as error:
                got = f"<load failed: {error}>"[:300]
            if got != version:
                wrong[handle.name] = got

        async with anyio.create_task_group() as tg:
            for handle in engines:
                tg.start_soon(one, handle)
        return wrong

    async def _one_token(self, engines: list[EngineHandle]) -> None:
        failed: dict[str, str] = {}

        async def one(handle: EngineHandle) -> None:
            payload = {"input_ids": [1], "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}}
            try:
                with anyio.fail_after(self.timeout):
                    await self.client.engine(handle.url).generate(payload, timeout=self.timeout, retry=NO_RETRY)
            except (EngineError, TimeoutError) as error:
                failed[handle.name] = str(error)[:300]

        async with anyio.create_task_group() as tg:
            for handle in engines:
                tg.start_soon(one, handle)
        if failed:
            raise EvalSkip("unhealthy", f"pinned engines did not answer a 1-token generate: {failed}")

    # -- generate and score --------------------------------------------------------------------------

    async def _evaluate(self, job: EvalJob, pinned: dict[str, int]) -> dict[str, dict[str, float]]:
        dispatcher = Dispatcher(client=self.client, pool=_PinnedPool(self.fleet, pinned),
                                engine_wait=self.pin_wait)
        semaphore = anyio.Semaphore(self.concurrency)
        results: dict[str, dict[str, float]] = {}
        for dataset in self.datasets:
            started = time.monotonic()
            groups: list[list[Sample]] = [[] for _ in dataset.records]

            async def run_group(index: int, record: PromptRecord, dataset: EvalDataset = dataset,
                                groups: list[list[Sample]] = groups) -> None:
                prompt_ids = list(self.tokenizer(str(record.prompt), add_special_tokens=False)["input_ids"])
                samples: list[Sample | None] = [None] * self.n_samples

                async def one(k: int) -> None:
                    samples[k] = await self._sample(dispatcher, semaphore, record, prompt_ids, index, k, job)

                async with anyio.create_task_group() as tg:
                    for k in range(self.n_samples):
                        tg.start_soon(one, k)
                done = [s for s in samples if s is not None]
                await dataset.reward_model.score_group(done)
                groups[index] = done

            async with anyio.create_task_group() as tg:
                for index, record in enumerate(dataset.records):
                    tg.start_soon(run_group, index, record)
            wrong = {s.metadata["engine"]: s.weight_versions[0] for g in groups for s in g
                     if s.weight_versions != [job.weight_version]}
            if wrong:
                raise EvalSkip("pin_violation", f"samples answered with weight versions {wrong}, pinned "
                                                f"{job.weight_version!r}")
            results[dataset.name] = _dataset_metrics(groups, self.config.reward_key, time.monotonic() - started)
        return results

    async def _sample(self, dispatcher: Dispatcher, semaphore: anyio.Semaphore, record: PromptRecord,
                      prompt_ids: list[int], group: int, index: int, job: EvalJob) -> Sample:
        payload = {
            "input_ids": prompt_ids,
            "sampling_params": {**self.sampling, "sampling_seed": (job.eval_id * 1_000_003 + group * 1_009 + index)
                                % (2**31 - 1)},
            "return_logprob": False,
            "rid": uuid.uuid4().hex,
        }
        async with semaphore:
            response, url = await dispatcher.generate(payload)
        meta = response.get("meta_info") or {}
        version = str(meta.get("weight_version", "default"))  # checked against the pin by the caller
        output_ids = [int(t) for t in (response.get("output_ids") or [])]
        finish = meta.get("finish_reason") or {}
        return Sample(
            group_index=group, sample_index=index, prompt=str(record.prompt), tokens=prompt_ids + output_ids,
            response_length=len(output_ids), loss_mask=[1] * len(output_ids), rollout_log_probs=[],
            status=_FINISH.get(finish.get("type") if isinstance(finish, dict) else None, SampleStatus.COMPLETED),
            weight_versions=[version], label=record.label, response=str(response.get("text", "")),
            metadata={**record.metadata, "prompt_index": record.index, "engine": url},
        )


def _dataset_metrics(groups: list[list[Sample]], reward_key: str | None, seconds: float) -> dict[str, float]:
    samples = [s for g in groups for s in g]
    rewards = [s.scalar_reward(reward_key) for s in samples]
    # pass@k: a prompt passes when any of its k samples earned the full reward
    passed = sum(any(s.scalar_reward(reward_key) >= 1.0 for s in g) for g in groups)
    return {
        "reward_mean": sum(rewards) / max(len(rewards), 1),
        "pass_at_k": passed / max(len(groups), 1),
        "truncated_ratio": sum(s.status is SampleStatus.TRUNCATED for s in samples) / max(len(samples), 1),
        "samples": float(len(samples)),
        "generate_s": seconds,
    }


def load_eval_datasets(config: Any) -> list[EvalDataset]:
    """`--eval-prompt-data NAME PATH ...`: JSONL/Parquet files, or `builtin:<task>` (32 prompts, seed + 1)."""
    from coordinator.rollout.manager import build_reward_model
    from coordinator.rollout.tasks import builtin_task_name, get_task, make_task_prompts

    datasets = []
    for name, path in config.eval_datasets:
        task = builtin_task_name(path)
        if task is not None:
            records = make_task_prompts(task, BUILTIN_EVAL_PROMPTS, config.rollout_seed + 1)
            reward_model: RewardModel | None = RewardModel(rm_type=get_task(task).rm_type,
                                                           reward_key=config.reward_key)
        else:
            records = read_prompt_file(path, input_key=config.input_key, label_key=config.label_key,
                                       metadata_key=config.metadata_key)
            reward_model = build_reward_model(config)
        if reward_model is None:
            raise ValueError(f"--eval-prompt-data {name} {path}: no reward to score it; give --rm-type or "
                             "--custom-rm-path")
        datasets.append(EvalDataset(name=name, records=records, reward_model=reward_model))
    return datasets
