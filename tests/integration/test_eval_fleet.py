"""EvalFleet: a full CPU run with a dedicated eval engine (evals at the interval, against the pinned version,
beside training), and the skip rules (pin_violation, unhealthy, busy)."""

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


def eval_config(model_dir: Path, run_dir: Path, *flags: str) -> Any:
    return parse_config([
        "--hf-checkpoint", str(model_dir), "--engine-backend", "cpu", "--rollout-num-engines", "1",
        "--actor-num-gpus-per-node", "1", "--prompt-data", "builtin:first_digit", "--num-rollout", "4",
        "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--rollout-max-response-len", "4",
        "--sglang-server-concurrency", "8", "--run-dir", str(run_dir), "--no-progress", "--lr", "1e-3",
        "--eval-num-engines", "1", "--eval-interval", "2", "--eval-prompt-data", "digits", "builtin:first_digit",
        "--n-samples-per-eval-prompt", "2", "--eval-max-response-len", "4", "--eval-max-in-flight", "2", *flags,
    ])


class Observer:
    """Training-loop hook (runs after the eval fleet's own hook): what training saw while evals ran."""

    def __init__(self, services: Services) -> None:
        self.services = services
        self.eval_pending_after_step: dict[int, bool] = {}
        self.eval_engine_version: dict[int, str] = {}
        self.rollout_engine_version: dict[int, str] = {}

    async def after_step(self, rollout_id: int, weight_version: str) -> None:
        eval_fleet = self.services.ft.eval_fleet  # type: ignore[union-attr]
        # The loop got here while the queued eval is still waiting or running: training was not held by it.
        self.eval_pending_after_step[rollout_id] = bool(eval_fleet.waiting or eval_fleet.running)
        client = self.services.client
        self.rollout_engine_version[rollout_id] = await client.engine(
            self.services.fleet.alive()[0].url).get_weight_version()
        eval_engine = self.services.eval_engines.engines[0]
        if eval_engine.alive:
            self.eval_engine_version[rollout_id] = await client.engine(eval_engine.url).get_weight_version()


async def test_evals_at_the_interval_record_metrics_against_the_pinned_version(tiny_model_dir: Path,
                                                                                tmp_path: Path) -> None:
    config = eval_config(tiny_model_dir, tmp_path / "run")
    observers: list[Observer] = []

    def hooks(services: Services) -> list[Any]:
        observers.append(Observer(services))
        return observers

    summary = await run_training(config, extra_hooks=hooks)
    observer = observers[0]
    assert summary["rollouts"] == 4 and summary["final_weight_version"] == "4"
    ft = summary["ft"]
    assert ft["monitors"] == [] and ft["eval_probes"] == 2, "unwatched: each of the 2 pins probed the 1 engine"
    evals = ft["evals"]
    assert [(e["pinned_step"], e["weight_version"], e["status"]) for e in evals] == [(1, "2", "done"),
                                                                                   (3, "4", "done")]
    # eval engines never receive training weight updates: after step 0 the rollout engine serves "1",
    # the eval engine still "0" (nothing pinned yet)
    assert observer.rollout_engine_version[0] == "1" and observer.eval_engine_version[0] == "0"
    assert all(v in ("0", "2", "4") for v in observer.eval_engine_version.values())
    assert observer.eval_pending_after_step[1] and observer.eval_pending_after_step[3]

    rows = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "eval/weight_version" in r]
    assert [(r["step"], r["eval/weight_version"]) for r in rows] == [(1, "2"), (3, "4")]
    for row in rows:
        assert row["eval/digits/pinned_step"] == row["step"]
        assert row["eval/digits/lag_steps"] >= 0 and row["eval/digits/duration_s"] > 0
        assert row["eval/digits/samples"] == 32 * 2
        assert 0.0 <= row["eval/digits/reward_mean"] <= 1.0
        assert 0.0 <= row["eval/digits/pass_at_k"] <= 1.0 and 0.0 <= row["eval/digits/truncated_ratio"] <= 1.0
    assert (tmp_path / "run" / "eval_weights" / "weights-4").is_dir()


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

        dead_fleet = EngineFleet(client=client, group="eval", external_urls=[gone.url], run_dir=tmp_path,
                                 probe_timeout=0.5, attach_timeout=0.5)
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


async def test_over_the_bound_the_oldest_waiting_eval_is_skipped_as_busy(tmp_path: Path) -> None:
    async with EngineClient(max_connections=2) as client:
        fleet = EngineFleet(client=client, group="eval", external_urls=["127.0.0.1:1"], run_dir=tmp_path)
        evals = EvalFleet(settings=fake_eval_settings(tmp_path, max_in_flight=2), fleet=fleet, client=client,
                          tokenizer=None, exporter=None, snapshot_dir=tmp_path, probe_before_pin=True, datasets=[])
        # run() is not started: every submitted eval waits
        for step in range(4):
            evals.submit(step, str(step + 1), str(tmp_path))
    assert [(r.pinned_step, r.reason) for r in evals.records] == [(0, "busy"), (1, "busy")]
    assert [job.pinned_step for job in evals.waiting] == [2, 3]


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
    triples = [[-0.5, 5, None]] if logprobs else []

    def response(finish: str) -> dict[str, Any]:
        return {"output_ids": [5], "meta_info": {"id": "r", "finish_reason": {"type": finish},
                                                 "weight_version": "2", "output_token_logprobs": triples}}

    sample = new_sample(record, prompt_ids, 0, 0)
    assert apply_response(state, sample, response("length"), logprobs=logprobs) == 1
    assert sample.status is SampleStatus.TRUNCATED and sample.weight_versions == ["2"]
    assert sample.response_length == 1 and len(sample.rollout_log_probs) == len(triples)
    with pytest.raises(ValueError, match="unknown finish_reason"):
        apply_response(state, new_sample(record, prompt_ids, 0, 1), response("weird"), logprobs=logprobs)
