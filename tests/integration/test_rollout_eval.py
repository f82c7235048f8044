"""Evaluation on the rollout engines (slime's default, no eval fleet): real CPU runs that write `eval/<name>/...`
metrics to metrics.jsonl at slime's schedule — before training, then after every `--eval-interval`-th rollout —
with the current weights, through the rollout's dispatcher. On one engine the module shares, with no training run:
the run's evaluator given an `--eval-config` as `base64:` (per-dataset settings, `--skip-eval-before-train`), and
an evaluation whose requests are aborted under it."""

from __future__ import annotations

import base64
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from coordinator.config import parse_config
from coordinator.observe.progress import read_metrics
from coordinator.run import run_training
from coordinator.services import Services
from replay.sample import SampleStatus
from tests.support.engine_proc import RunningEngine, start_engine_process
from tests.support.waiting import wait_until


def run_argv(model_dir: Path, run_dir: Path, *flags: str) -> list[str]:
    return ["--hf-checkpoint", str(model_dir), "--engine-backend", "cpu", "--rollout-num-engines", "1",
            "--actor-num-gpus-per-node", "1", "--prompt-data", "builtin:first_digit", "--rollout-batch-size", "2",
            "--n-samples-per-prompt", "2", "--rollout-max-response-len", "4", "--sglang-server-concurrency", "8",
            "--run-dir", str(run_dir), "--no-progress", "--lr", "1e-3", *flags]


class EngineVersions:
    """Training-loop hook after the evaluator's: the version the rollout engine serves after each step."""

    def __init__(self, services: Services) -> None:
        self.services = services
        self.versions: dict[int, str] = {}

    async def after_step(self, rollout_id: int, weight_version: str) -> None:
        assert self.services.client is not None and self.services.fleet is not None
        engine = self.services.client.engine(self.services.fleet.alive()[0].url)
        self.versions[rollout_id] = await engine.get_weight_version()


async def test_eval_on_the_rollout_engines_at_slimes_schedule(tiny_model_dir: Path, tmp_path: Path) -> None:
    config = parse_config(run_argv(tiny_model_dir, tmp_path / "run", "--num-rollout", "4", "--eval-interval", "2",
                                   "--eval-prompt-data", "digits", "builtin:first_digit",
                                   "--n-samples-per-eval-prompt", "2", "--eval-max-response-len", "3"))
    assert config.rollout_engine_eval_enabled and not config.eval_fleet_enabled
    observers: list[EngineVersions] = []

    def hooks(services: Services) -> list[Any]:
        observers.append(EngineVersions(services))
        return observers

    summary = await run_training(config, extra_hooks=hooks)
    assert summary["rollouts"] == 4 and summary["final_weight_version"] == "4"
    assert summary["ft"]["evals"] == [], "no eval fleet was started"

    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    evals = [row for row in rows if "eval/step" in row]
    # before training (step 0, weights "0"), then after rollouts 1 and 3 (interval 2), after their weight sync
    assert [(row["step"], row["eval/step"], row["eval/weight_version"]) for row in evals] == [
        (0, 0, "0"), (1, 1, "2"), (3, 3, "4")]
    assert observers[0].versions[1] == "2" and observers[0].versions[3] == "4", "the version evaluated"
    for row in evals:
        assert row["eval/off_version_samples"] == 0, "every sample answered by the current weights"
        assert row["eval/digits/samples"] == 32 * 2
        assert 0.0 <= row["eval/digits"] <= 1.0 and row["eval/digits"] == row["eval/digits/reward_mean"]
        assert 0.0 <= row["eval/digits-pass@1"] <= row["eval/digits-pass@2"] <= 1.0
        assert row["eval/digits-pass@2"] == row["eval/digits/pass_at_k"]
        assert row["eval/digits/truncated_ratio"] == row["eval/digits-truncated_ratio"]
        assert 0 <= row["eval/digits/response_len/min"] <= row["eval/digits/response_len/median"] <= 3
        assert row["eval/digits/response_len/max"] <= 3, "--eval-max-response-len 3 bounds the responses"
        assert row["eval/digits/truncated_ratio"] == 0 or row["eval/digits/response_len/max"] == 3
        assert row["eval/duration_s"] > 0
    # the training rows are untouched: one per rollout, none of them an eval row
    assert [row["step"] for row in rows if "rollout/reward_mean" in row] == [0, 1, 2, 3]
    assert [e["eval/step"] for e in summary["rollout_engine_evals"]] == [0, 1, 3]


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> Iterator[RunningEngine]:
    """One real CPU engine for the tests that drive the evaluator without a training run (each leaves it as it
    found it: no weight update; an abort ends only the requests then in flight)."""
    with start_engine_process(tiny_model_dir) as running:
        yield running


async def test_eval_config_in_base64_with_per_dataset_settings(tiny_model_dir: Path, engine: RunningEngine,
                                                               tmp_path: Path) -> None:
    """The run's evaluator (`RolloutEngineEval`, built from the flags as the run builds it) on a real engine:
    `--skip-eval-before-train` leaves out the evaluation before training, an `--eval-interval 1` one is due after
    rollout 0, and each dataset of the base64 `--eval-config` is sampled with its own settings into the row.
    (The schedule within a whole run, the evaluations after its weight syncs: the first test.)"""
    import anyio
    from transformers import AutoTokenizer

    from coordinator.engines.client import EngineClient
    from coordinator.engines.fleet import EngineFleet
    from coordinator.eval.rollout_engines import RolloutEngineEval
    from coordinator.eval.settings import EvalSettings, load_eval_datasets
    from coordinator.observe.progress import MetricsLog
    from coordinator.rollout.dispatch import Dispatcher
    from coordinator.rollout.requests import GenerateState

    yaml_text = ("eval:\n"
                 "  defaults: {max_response_len: 2}\n"
                 "  datasets:\n"
                 "    - {name: digits, path: 'builtin:first_digit', n_samples_per_eval_prompt: 2}\n"
                 "    - {name: copies, path: 'builtin:copy', rm_type: boxed_exact_match, max_response_len: 1,\n"
                 "       temperature: 0.0}\n")
    value = "base64:" + base64.b64encode(yaml_text.encode()).decode()
    config = parse_config(run_argv(tiny_model_dir, tmp_path / "run", "--num-rollout", "1", "--eval-interval", "1",
                                   "--eval-config", value, "--skip-eval-before-train"))
    settings = EvalSettings.from_slices(config.eval, rollout=config.rollout, sglang=config.sglang)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    rollout_state = GenerateState(tokenizer=tokenizer, sampling_params={}, max_response_len=4,
                                  context_length=1 << 20, concurrency=8, seed=0)
    metrics = MetricsLog(tmp_path / "run")
    async with EngineClient(max_connections=8) as client, anyio.create_task_group() as group:
        fleet = EngineFleet(client=client, group="rollout", external_urls=[engine.url], run_dir=tmp_path)
        await group.start(fleet.run)
        version = await client.engine(engine.url).get_weight_version()
        evaluator = RolloutEngineEval(settings=settings, datasets=load_eval_datasets(settings, tokenizer),
                                      rollout_state=rollout_state, dispatcher=Dispatcher(client=client, pool=fleet),
                                      metrics=metrics)
        await evaluator.before_loop(0, version)
        assert evaluator.records == [], "--skip-eval-before-train: nothing before the first rollout"
        assert evaluator.due(0)
        with anyio.fail_after(120):
            await evaluator.after_step(0, version)
        group.cancel_scope.cancel()
    metrics.close()
    evals = [row for row in read_metrics(tmp_path / "run" / "metrics.jsonl") if "eval/step" in row]
    assert [(row["step"], row["eval/weight_version"]) for row in evals] == [(0, version)]
    for row in evals:
        assert row["eval/off_version_samples"] == 0
        assert row["eval/digits/samples"] == 64 and row["eval/digits/response_len/max"] <= 2
        assert row["eval/copies/samples"] == 32 and row["eval/copies/response_len/max"] <= 1
        assert "eval/copies-pass@1" not in row, "pass@k only where n > 1"
        # boxed_exact_match: 1-token responses hold no \boxed{}, so nothing is right
        assert row["eval/copies"] == 0.0


async def test_samples_aborted_under_an_evaluation_are_generated_again(tiny_model_dir: Path, engine: RunningEngine,
                                                                       tmp_path: Path) -> None:
    """With --async-rollout a rollout that fills its batch aborts every request on the engines, the eval's
    too: a real engine aborts them mid-generation here, and the evaluation generates them again."""
    import anyio
    from transformers import AutoTokenizer

    from coordinator.engines.client import EngineClient
    from coordinator.engines.fleet import EngineFleet
    from coordinator.eval.run import evaluate_dataset, generate_state
    from coordinator.eval.settings import EvalSettings, load_eval_datasets
    from coordinator.rollout.dispatch import Dispatcher

    config = parse_config(run_argv(tiny_model_dir, tmp_path / "run", "--num-rollout", "1", "--eval-interval", "1",
                                   "--eval-prompt-data", "digits", "builtin:first_digit",
                                   "--n-samples-per-eval-prompt", "1", "--eval-max-response-len", "256"))
    settings = EvalSettings.from_slices(config.eval, rollout=config.rollout, sglang=config.sglang)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    (dataset,) = load_eval_datasets(settings, tokenizer)
    async with EngineClient(max_connections=8) as client, anyio.create_task_group() as group:
        fleet = EngineFleet(client=client, group="rollout", external_urls=[engine.url], run_dir=tmp_path)
        await group.start(fleet.run)
        dispatcher = Dispatcher(client=client, pool=fleet)
        state = generate_state(dataset, tokenizer=tokenizer, context_length=1 << 20,
                               concurrency=64)
        aborted_at = anyio.Event()

        async def generating() -> tuple[float, float]:
            """The engine's running requests and tokens generated so far (its /metrics)."""
            text = await client.engine(engine.url).metrics()
            values = {re.split(r"[{ ]", line, maxsplit=1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                      if line.startswith(("sglang:num_running_reqs", "sglang:generation_tokens_total"))}
            return values["sglang:num_running_reqs"], values["sglang:generation_tokens_total"]

        _, generated_before = await generating()  # the shared engine has generated for other tests

        async def abort_once_generation_runs() -> None:
            await wait_until(generating, until=lambda seen: seen[0] >= 1 and seen[1] >= generated_before + 16,
                             timeout=60,
                             what="the eval's requests generating on the engine (running, 16 tokens out)")
            await client.engine(engine.url).abort_request(abort_all=True)
            aborted_at.set()

        group.start_soon(abort_once_generation_runs)
        groups, metrics = await evaluate_dataset(dataset, state, dispatcher, eval_id=0)
        assert aborted_at.is_set()
        group.cancel_scope.cancel()
    samples = [sample for g in groups for sample in g]
    restarted = [sample for sample in samples if sample.metadata.get("eval_restarts")]
    assert restarted, "the abort hit requests in flight"
    assert metrics["eval/digits/aborted"] == 0 and metrics["eval/digits/samples"] == 32
    assert all(sample.status is not SampleStatus.ABORTED and sample.reward is not None for sample in samples)
    assert all(sample.response_length > 0 for sample in restarted), "generated again from the prompt"

