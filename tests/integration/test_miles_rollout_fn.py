"""miles' class-based rollout API in a real run: a class shaped like miles' `VerifiersRolloutFn`
(tests/support/miles_rollout_fns.py, written against miles' records imported from `coordinator.hooks`) as
--rollout-function-path, serving evaluation too (the eval path defaults to it: one instance). One CPU engine,
--debug-rollout-only (no training ranks: the API is the coordinator's), two rollouts, an evaluation before the
first and after each."""

from __future__ import annotations

from pathlib import Path

from coordinator.config import parse_config
from coordinator.hooks import RolloutFnEvalInput, RolloutFnTrainInput
from coordinator.observe.progress import read_metrics
from coordinator.run import run_training
from replay.format import dump_path
from replay.reader import read_dump
from tests.support.miles_rollout_fns import EVAL_PROMPTS, VerifiersShapedRolloutFn


async def test_a_miles_rollout_class_generates_trains_inputs_and_evaluates_in_a_real_run(tiny_model_dir: Path,
                                                                                      tmp_path: Path) -> None:
    VerifiersShapedRolloutFn.INSTANCES.clear()
    run_dir = tmp_path / "run"
    config = parse_config([
        "--hf-checkpoint", str(tiny_model_dir), "--engine-backend", "cpu", "--rollout-num-engines", "1",
        "--debug-rollout-only", "--prompt-data", "builtin:first_digit", "--num-rollout", "2",
        "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--rollout-max-response-len", "2",
        "--rollout-function-path", "tests.support.miles_rollout_fns:VerifiersShapedRolloutFn",
        "--eval-interval", "1", "--eval-prompt-data", "digits", "builtin:first_digit",
        "--save-debug-rollout-data", str(run_dir / "dumps" / "{rollout_id}.rld"),
        "--run-dir", str(run_dir), "--no-progress",
    ])
    summary = await run_training(config)
    assert summary["rollouts"] == 2

    [instance] = VerifiersShapedRolloutFn.INSTANCES  # built once, serving train and eval
    assert instance.max_concurrent == config.sglang.sglang_server_concurrency * 1
    assert instance.inputs == [RolloutFnEvalInput(rollout_id=0, weight_version="0"),
                               RolloutFnTrainInput(rollout_id=0, weight_version=0),
                               RolloutFnEvalInput(rollout_id=0, weight_version="0"),
                               RolloutFnTrainInput(rollout_id=1, weight_version=0),
                               RolloutFnEvalInput(rollout_id=1, weight_version="0")]
    for rollout_id in range(2):
        samples = read_dump(dump_path(str(run_dir / "dumps" / "{rollout_id}.rld"), rollout_id)).samples
        assert len(samples) == 4 and all(1 <= s.response_length <= 2 for s in samples)
        assert all(s.reward == float(s.response.strip()[:1] == str(s.label)) for s in samples)
        assert all(s.weight_versions == ["0"] for s in samples)

    rows = read_metrics(run_dir / "metrics.jsonl")
    evals = [r for r in rows if "eval/digits" in r]
    assert [(r["step"], r["verifiers/eval_rollout_id"]) for r in evals] == [(0, 0), (0, 0), (1, 1)]
    for row in evals:
        assert 0.0 <= row["eval/digits"] <= 1.0 and row["eval/digits-none_reward_ratio"] == 0.0
        assert row["eval/digits/samples"] == len(EVAL_PROMPTS) and "eval/digits-truncated_ratio" in row
    trained = [r for r in rows if "verifiers/weight_version" in r]
    assert [r["step"] for r in trained] == [0, 1]
