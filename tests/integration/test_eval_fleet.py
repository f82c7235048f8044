"""EvalFleet: a full CPU run with a dedicated eval engine and miles' fleet flags (evals at the interval, against
the pinned snapshot, beside training), and the skip rules (pin_violation, unhealthy, busy, the final eval); a
run whose snapshots go to miles' CheckpointEvalFn instead of eval engines."""

from __future__ import annotations

import dataclasses
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import anyio
import pytest

from coordinator.config import parse_config
from coordinator.data.source import PromptRecord
from coordinator.engines.client import EngineClient
from coordinator.engines.fleet import EngineFleet
from coordinator.engines.replies import FinishReason, GenerateReply
from coordinator.eval.fleet import EvalFleet, EvalSkip
from coordinator.eval.settings import EVAL_SEED, EvalSettings
from coordinator.lifecycle.processes import terminate_process_group_blocking
from coordinator.observe.progress import MetricsLog, read_metrics
from coordinator.rollout.requests import GenerateState, apply_response, new_sample
from coordinator.run import run_training
from coordinator.services import Services
from replay.sample import SampleStatus
from tests.support.engine_proc import start_engine_process
from tests.support.fake_engine import FakeEngine
from tests.support.miles_rollout_fns import SnapshotReadingEvalFn


def eval_config(model_dir: Path, run_dir: Path, *flags: str) -> Any:
    return parse_config([
        "--hf-checkpoint", str(model_dir), "--engine-backend", "cpu", "--rollout-num-engines", "1",
        "--actor-num-gpus-per-node", "1", "--prompt-data", "builtin:first_digit", "--num-rollout", "4",
        "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--rollout-max-response-len", "4",
        "--sglang-server-concurrency", "8", "--run-dir", str(run_dir), "--no-progress", "--lr", "1e-3",
        "--eval-num-engines", "1", "--eval-interval", "1", "--eval-prompt-data", "digits", "builtin:first_digit",
        "--n-samples-per-eval-prompt", "1", "--eval-max-response-len", "4", *flags,
    ])


class Observer:
    """Training-loop hook (runs after the eval fleet's own hook): what training saw while evals ran.

    It holds the eval engine's generation (SGLang's `/pause_generation` in_place) from step 0 to step 1, so the
    evaluation of step 0 is still running when the one of step 1 is due, then waits for it to settle, so the
    one of step 2 runs: the busy skip happens at step 1 and nowhere else."""

    def __init__(self, services: Services, snapshot_dir: Path) -> None:
        self.services = services
        self.snapshot_dir = snapshot_dir
        self.eval_pending_after_step: dict[int, bool] = {}
        self.eval_engine_version: dict[int, str] = {}
        self.rollout_engine_version: dict[int, str] = {}
        self.snapshots_on_disk: dict[int, list[str]] = {}

    async def after_step(self, rollout_id: int, weight_version: str) -> None:
        eval_fleet = self.services.ft.eval_fleet  # type: ignore[union-attr]
        # The loop got here while the queued eval is still waiting or running: training was not held by it.
        self.eval_pending_after_step[rollout_id] = eval_fleet.pending > 0
        self.snapshots_on_disk[rollout_id] = sorted(path.name for path in self.snapshot_dir.iterdir())
        client = self.services.client
        self.rollout_engine_version[rollout_id] = await client.engine(
            self.services.fleet.alive()[0].url).get_weight_version()
        eval_engine = self.services.eval_engines.engines[0]
        engine = client.engine(eval_engine.url)
        if eval_engine.alive:
            self.eval_engine_version[rollout_id] = await engine.get_weight_version()
        if rollout_id == 0:
            await engine.pause_generation("in_place")
        elif rollout_id == 1:
            await engine.continue_generation()
            with anyio.fail_after(120):
                while eval_fleet.pending:
                    await eval_fleet._wait_changed()


async def test_evals_pinned_to_exported_snapshots_with_miles_fleet_flags(tiny_model_dir: Path,
                                                                          tmp_path: Path) -> None:
    """miles' spelling of the fleet (--eval-num-engines standing in for --eval-num-gpus): snapshots at
    --eval-hf-dir/step_<rollout_id>, --eval-keep-snapshots 1, --eval-max-in-flight 1, --eval-overflow-policy
    skip: one evaluation due while another runs is skipped (eval/skipped_busy at its step), the final one is
    not, and each evaluation is pinned to the weights its step exported."""
    hf_dir = tmp_path / "eval_hf"
    config = eval_config(tiny_model_dir, tmp_path / "run", "--eval-hf-dir", str(hf_dir), "--eval-keep-snapshots",
                         "1", "--eval-max-in-flight", "1", "--eval-overflow-policy", "skip",
                         "--skip-eval-before-train")
    observers: list[Observer] = []

    def hooks(services: Services) -> list[Any]:
        observers.append(Observer(services, hf_dir))
        return observers

    summary = await run_training(config, extra_hooks=hooks)
    observer = observers[0]
    assert summary["rollouts"] == 4 and summary["final_weight_version"] == "4"
    ft = summary["ft"]
    assert ft["monitors"] == [] and ft["eval_probes"] == 3, "unwatched: each of the 3 pins probed the 1 engine"
    evals = ft["evals"]
    assert sorted((e["pinned_step"], e["weight_version"], e["status"], e["reason"]) for e in evals) == [
        (0, "1", "done", None), (1, "2", "skipped", "busy"), (2, "3", "done", None), (3, "4", "done", None)]
    # eval engines never receive training weight updates: after step 1 the rollout engine serves "2", the
    # eval engine what eval 0 pinned ("1"), and never a version whose evaluation was skipped
    assert observer.rollout_engine_version[1] == "2" and observer.eval_engine_version[1] in ("0", "1")
    assert all(v in ("0", "1", "3", "4") for v in observer.eval_engine_version.values())
    assert observer.eval_pending_after_step[0]

    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    done = [r for r in rows if "eval/digits/reward_mean" in r]
    assert [(r["step"], r["eval/weight_version"]) for r in done] == [(0, "1"), (2, "3"), (3, "4")]
    for row in done:
        assert row["eval/digits/pinned_step"] == row["step"]
        assert row["eval/digits/lag_steps"] >= 0 and row["eval/digits/duration_s"] > 0
        assert row["eval/digits/samples"] == 32
        assert 0.0 <= row["eval/digits/reward_mean"] <= 1.0
        assert 0.0 <= row["eval/digits/pass_at_k"] <= 1.0 and 0.0 <= row["eval/digits/truncated_ratio"] <= 1.0
    assert [(r["step"], r["eval/skip_reason"]) for r in rows if r.get("eval/skipped_busy") == 1.0] == [(1, "busy")]
    # snapshots: miles' layout, at most the kept one once settled (plus the one in flight while it runs)
    assert all(len(names) <= 2 and all(name.startswith("step_") for name in names)
               for names in observer.snapshots_on_disk.values()), observer.snapshots_on_disk
    assert sorted(path.name for path in hf_dir.iterdir()) == ["step_3"]
    assert (hf_dir / "step_3" / "rayless_weight_version.txt").read_text().strip() == "4"
    assert (hf_dir / "step_3" / "model.safetensors").is_file()
    assert not (tmp_path / "run" / "eval_weights").exists()


async def test_without_eval_hf_dir_the_fleet_reuses_the_save_hf_checkpoints(tiny_model_dir: Path,
                                                                            tmp_path: Path) -> None:
    """miles: with --save-hf and no --eval-hf-dir each evaluation pins that step's --save-hf directory (the
    interval a multiple of --save-interval); the fleet exports nothing and deletes none of them."""
    save_hf = tmp_path / "hf" / "rollout_{rollout_id}"
    config = eval_config(tiny_model_dir, tmp_path / "run", "--num-rollout", "2", "--save-hf", str(save_hf),
                         "--save-interval", "1", "--skip-eval-before-train")
    summary = await run_training(config)
    evals = summary["ft"]["evals"]
    assert [(e["pinned_step"], e["weight_version"], e["status"], e["snapshot"]) for e in evals] == [
        (0, "1", "done", str(tmp_path / "hf" / "rollout_0")), (1, "2", "done", str(tmp_path / "hf" / "rollout_1"))]
    assert sorted(path.name for path in (tmp_path / "hf").iterdir()) == ["rollout_0", "rollout_1"]
    assert all((tmp_path / "hf" / name / "config.json").is_file() for name in ("rollout_0", "rollout_1"))
    assert not (tmp_path / "run" / "eval_weights").exists()


async def test_a_checkpoint_eval_fn_gets_each_exported_snapshot_beside_training(tiny_model_dir: Path,
                                                                                 tmp_path: Path) -> None:
    """miles' CheckpointEvalFn as --eval-function-path, no eval engines: the base checkpoint first, then each
    step's export at --eval-hf-dir/step_<rollout_id> handed to the backend (it reads the exported weight version
    there), at most --eval-keep-snapshots 1 settled snapshot on disk, the backend's EvalSkip logged as
    eval/skipped_<reason> at its step, the final evaluation done, and the backend disposed at the end."""
    SnapshotReadingEvalFn.CALLS.clear()
    SnapshotReadingEvalFn.DISPOSED.clear()
    SnapshotReadingEvalFn.SKIP_VERSION = "1"
    hf_dir, run_dir = tmp_path / "eval_hf", tmp_path / "run"
    config = parse_config([
        "--hf-checkpoint", str(tiny_model_dir), "--engine-backend", "cpu", "--rollout-num-engines", "1",
        "--actor-num-gpus-per-node", "1", "--prompt-data", "builtin:first_digit", "--num-rollout", "2",
        "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--rollout-max-response-len", "4",
        "--run-dir", str(run_dir), "--no-progress", "--lr", "1e-3", "--eval-interval", "1",
        "--eval-function-path", "tests.support.miles_rollout_fns:SnapshotReadingEvalFn",
        "--eval-prompt-data", "digits", "builtin:first_digit", "--eval-hf-dir", str(hf_dir), "--eval-keep-snapshots", "1", "--eval-max-in-flight", "1",
    ])
    summary = await run_training(config)
    assert summary["rollouts"] == 2 and summary["ft"]["evals"] == []
    calls = SnapshotReadingEvalFn.CALLS
    assert [(step, version, snapshot, read) for step, version, snapshot, read, _ in calls] == [
        (0, "0", str(tiny_model_dir), "base"), (0, "1", str(hf_dir / "step_0"), "1"),
        (1, "2", str(hf_dir / "step_1"), "2")]
    assert [siblings for *_, siblings in calls[1:]] == [["step_0"], ["step_0", "step_1"]]  # kept + evaluated
    assert [(e["pinned_step"], e["status"], e["reason"]) for e in summary["checkpoint_evals"]] == [
        (0, "done", None), (0, "skipped", "backend_busy"), (1, "done", None)]
    assert sorted(path.name for path in hf_dir.iterdir()) == ["step_1"]
    assert SnapshotReadingEvalFn.DISPOSED == [True]
    rows = read_metrics(run_dir / "metrics.jsonl")
    done = [r for r in rows if "eval/snapshot" in r]
    assert [(r["step"], r["eval/weight_version"], r["snapshot/version_read"]) for r in done] == [
        (0, "0", -1.0), (1, "2", 2.0)]
    assert all(r["eval/snapshot"] == 0.5 and r["eval/lag_steps"] >= 0 for r in done)
    assert [(r["step"], r["eval/weight_version"]) for r in rows if r.get("eval/skipped_backend_busy") == 1.0] \
        == [(0, "1")]


def fake_eval_settings(tmp_path: Path, max_in_flight: int = 1) -> EvalSettings:
    config = parse_config([
        "--hf-checkpoint", str(tmp_path), "--rollout-num-engines", "1", "--prompt-data", "builtin:first_digit",
        "--num-rollout", "1", "--rollout-batch-size", "1", "--eval-num-engines", "1", "--eval-interval", "1",
        "--eval-prompt-data", "digits", "builtin:first_digit", "--eval-max-in-flight", str(max_in_flight),
    ])
    return EvalSettings.from_slices(config.eval, rollout=config.rollout, sglang=config.sglang)


async def test_a_stale_engine_is_a_pin_violation_and_a_dead_fleet_is_unhealthy(tmp_path: Path) -> None:
    """FAKE engines: one that reports a stale version after every load cannot be made from the real one."""
    stale, gone = FakeEngine(), FakeEngine()
    stale.stale_version = "old"
    async with EngineClient(max_connections=8) as client, anyio.create_task_group() as group:
        await group.start(stale.run)
        await group.start(gone.run)
        fleet = EngineFleet(client=client, group="eval", external_urls=[stale.url], run_dir=tmp_path,
                            probe_timeout=1)
        await group.start(fleet.run)
        metrics = MetricsLog(tmp_path)
        evals = EvalFleet(settings=fake_eval_settings(tmp_path), fleet=fleet, client=client, tokenizer=None,
                          exporter=None, snapshot_dir=tmp_path / "eval_weights", metrics=metrics,
                          probe_before_pin=True, datasets=[])
        with pytest.raises(EvalSkip) as skip:
            await evals.pin(str(tmp_path), "3")
        assert skip.value.reason == "pin_violation" and "old" in skip.value.detail
        assert stale.requests["/update_weights_from_disk"] == 2, "loaded, checked, loaded once more"

        # The first attach must succeed (the FAKE serves until stop_serving): a deadline a loaded machine cannot
        # miss, spent only if it does; once gone, the probes fail at once and the pin waits `pin_wait`.
        dead_fleet = EngineFleet(client=client, group="eval", external_urls=[gone.url], run_dir=tmp_path,
                                 probe_timeout=0.5, attach_timeout=30)
        await group.start(dead_fleet.run)
        gone.stop_serving()
        dead = EvalFleet(settings=fake_eval_settings(tmp_path), fleet=dead_fleet, client=client, tokenizer=None,
                         exporter=None, snapshot_dir=tmp_path / "eval_weights", metrics=metrics,
                         probe_before_pin=True, pin_wait=0.5, datasets=[])
        await group.start(dead.run)
        dead.submit(5, "5", str(tmp_path))
        with anyio.fail_after(10):
            await dead.drain(timeout=10)
        assert [(r.status, r.reason) for r in dead.records] == [("skipped", "unhealthy")]
        assert dead.probes == 1
        metrics.close()
        rows = read_metrics(tmp_path / "metrics.jsonl")
        assert rows[-1]["eval/skip_reason"] == "unhealthy" and rows[-1]["step"] == 5
        group.cancel_scope.cancel()


async def test_one_of_two_eval_engines_down_skips_the_eval_unless_a_partial_fleet_is_allowed(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Two real eval engines (attached), one killed for good: the seed's rule — the eval waits for every
    engine and is skipped as unhealthy, nothing pinned on the survivor; allowed explicitly, it runs on the
    survivor and its record says 1 of 2 engines."""
    with ExitStack() as stack:
        engines = [stack.enter_context(start_engine_process(tiny_model_dir)) for _ in range(2)]
        async with EngineClient(max_connections=8) as client, anyio.create_task_group() as group:
            fleet = EngineFleet(client=client, group="eval", external_urls=[e.url for e in engines], run_dir=tmp_path,
                                probe_timeout=5, attach_timeout=1)
            await group.start(fleet.run)
            start_version = await client.engine(engines[0].url).get_weight_version()
            terminate_process_group_blocking(engines[1].process, grace=5)
            metrics = MetricsLog(tmp_path)
            settings = fake_eval_settings(tmp_path)
            for allow_partial in (False, True):
                evals = EvalFleet(settings=dataclasses.replace(settings, allow_partial_fleet=allow_partial),
                                  fleet=fleet, client=client, tokenizer=None, exporter=None,
                                  snapshot_dir=tmp_path / "eval_weights", metrics=metrics, probe_before_pin=True,
                                  pin_wait=1.0, datasets=[])
                await group.start(evals.run)
                evals.submit(3, "1", str(tiny_model_dir))
                with anyio.fail_after(60):
                    await evals.drain(timeout=60)
                record = evals.records[0]
                survivor = await client.engine(engines[0].url).get_weight_version()
                if not allow_partial:
                    assert (record.status, record.reason) == ("skipped", "unhealthy"), record
                    assert "1 of 2 eval engines alive" in record.detail and "eval-ext-1" in record.detail
                    assert survivor == start_version, "nothing was pinned on the one engine left"
                else:
                    assert record.status == "done", record
                    assert record.metrics["eval/engines"] == 1 and record.metrics["eval/engines_total"] == 2
                    assert survivor == "1"
            metrics.close()
            rows = read_metrics(tmp_path / "metrics.jsonl")
            assert [(r.get("eval/skip_reason"), r.get("eval/engines")) for r in rows] == [("unhealthy", None),
                                                                                         (None, 1)]
            group.cancel_scope.cancel()


@pytest.mark.parametrize("policy", ["skip", "backpressure"])
async def test_over_the_bound_skip_drops_the_new_eval_backpressure_waits_and_the_final_one_always_runs(
    tmp_path: Path, policy: str
) -> None:
    """miles' EvalDispatcher: at --eval-max-in-flight pending, `skip` records the new eval as busy (at its step)
    and `backpressure` waits for the oldest to settle; the final eval waits under either policy. FAKE engine:
    one that stops serving, so each admitted eval settles (unhealthy) only once the fleet's task runs it."""
    gone = FakeEngine()
    async with EngineClient(max_connections=8) as client, anyio.create_task_group() as group:
        await group.start(gone.run)
        fleet = EngineFleet(client=client, group="eval", external_urls=[gone.url], run_dir=tmp_path,
                            probe_timeout=0.5, attach_timeout=30)  # the first attach succeeds; see above
        await group.start(fleet.run)
        gone.stop_serving()
        metrics = MetricsLog(tmp_path)
        settings = dataclasses.replace(fake_eval_settings(tmp_path, max_in_flight=1), overflow_policy=policy)
        evals = EvalFleet(settings=settings, fleet=fleet, client=client, tokenizer=None, exporter=None,
                          snapshot_dir=tmp_path / "eval_weights", metrics=metrics, probe_before_pin=True,
                          pin_wait=0.5, datasets=[])
        # the fleet's task is not running yet: the first eval stays pending
        assert await evals.dispatch(0, "1") is not None and evals.pending == 1
        admitted: list[Any] = []

        async def dispatch(step: int, final: bool) -> None:
            admitted.append(await evals.dispatch(step, str(step + 1), final=final))

        with anyio.fail_after(30):
            async with anyio.create_task_group() as dispatching:
                if policy == "skip":
                    await dispatch(1, final=False)  # returns at once: skipped as busy
                    assert admitted == [None] and evals.pending == 1
                dispatching.start_soon(dispatch, 2, True)  # waits for eval 0 to settle
                await anyio.wait_all_tasks_blocked()
                assert len(admitted) == (1 if policy == "skip" else 0), "the final eval waits, never skipped"
                await group.start(evals.run)
            await evals.drain(timeout=30)
        metrics.close()
        expected = [(0, "unhealthy"), (2, "unhealthy")] + ([(1, "busy")] if policy == "skip" else [])
        assert sorted((r.pinned_step, r.reason) for r in evals.records) == sorted(expected)
        rows = read_metrics(tmp_path / "metrics.jsonl")
        assert [r["step"] for r in rows if r.get("eval/skipped_busy")] == ([1] if policy == "skip" else [])
        assert [r["step"] for r in rows if r.get("eval/skipped_unhealthy")] == [0, 2]
        group.cancel_scope.cancel()


async def test_a_run_from_rollout_0_first_evaluates_the_base_checkpoint_on_the_fleet(tmp_path: Path) -> None:
    """miles' train_async dispatches `--hf-checkpoint` itself at step 0 before training (never exported, never
    deleted), unless --skip-eval-before-train or the run resumes."""
    async with EngineClient(max_connections=1) as client:
        fleet = EngineFleet(client=client, group="eval", external_urls=["127.0.0.1:1"], run_dir=tmp_path)
        for skip, start, expected in ((False, 0, [(0, "0", str(tmp_path), False)]), (True, 0, []), (False, 3, [])):
            settings = dataclasses.replace(fake_eval_settings(tmp_path), skip_before_train=skip)
            evals = EvalFleet(settings=settings, fleet=fleet, client=client, tokenizer=None, exporter=None,
                              snapshot_dir=tmp_path / "eval_weights", probe_before_pin=True, datasets=[])
            await evals.before_loop(start, "0")  # run() is not started: the eval stays queued
            assert [(j.pinned_step, j.weight_version, j.snapshot, j.exported) for j in evals.waiting] == expected


@pytest.mark.parametrize("logprobs", [False, True], ids=["eval", "rollout"])
def test_eval_and_rollout_read_a_response_with_the_same_code(tiny_model_dir: Path, logprobs: bool) -> None:
    """Eval (no logprobs) and the default rollout (logprobs) parse responses with one function: the same
    status for a known finish reason, and the same error for an unknown one (eval once mapped it to
    COMPLETED)."""
    from transformers import AutoTokenizer

    state = GenerateState(tokenizer=AutoTokenizer.from_pretrained(tiny_model_dir), sampling_params={},
                          max_response_len=4, context_length=64, concurrency=1, seed=EVAL_SEED)
    record = PromptRecord(prompt="3 7 1=", label="3", index=0)
    prompt_ids = state.encode("3 7 1=")
    triples = [-0.5] if logprobs else []

    def response(finish: str) -> GenerateReply:  # a checked reply; no check passes a finish of "weird"
        return GenerateReply(text="5", output_ids=(5,), logprobs=tuple(triples) if logprobs else None,
                             finish=FinishReason(finish), weight_version="2", rid="r")

    sample = new_sample(record, prompt_ids, 0, 0)
    assert apply_response(state, sample, response("length"), logprobs=logprobs) == 1
    assert sample.status is SampleStatus.TRUNCATED and sample.weight_versions == ["2"]
    assert sample.response_length == 1 and len(sample.rollout_log_probs) == len(triples)
    with pytest.raises(ValueError, match="unknown finish_reason"):
        apply_response(state, new_sample(record, prompt_ids, 0, 1), response("weird"), logprobs=logprobs)
