"""Environments built with the `verifiers` package train through rayless: a real run (CPU engine, torchrun
rank, the coordinator's session server) whose agent runs a verifiers environment's own rollout
(`Environment.run_rollout` with verifiers' OpenAI chat client) against the sample's session `base_url`.

Two environments of examples/verifiers_env/: the multi-turn tool one (`vf.MultiTurnEnv`, through the
adapter's generic `run_agent` named by $RAYLESS_VERIFIERS_ENV, its arguments in $RAYLESS_VERIFIERS_ENV_ARGS)
and the single-turn one (`vf.SingleTurnEnv`, through `make_agent`). Checked on every dumped sample: it holds every turn verifiers ran (its `num_turns`
metric), the tool's output between them untrained; the loss mask is 1 exactly on the tokens the engine
generated (logprob 0.0 elsewhere); the reward is the rubric's and agrees with the answer in the trained
tokens; and the trainer's logprobs match the engine's within 1e-4 on every rollout.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
from transformers import AutoTokenizer

from coordinator.config import parse_config
from coordinator.observe.progress import read_metrics
from coordinator.run import run_training
from coordinator.sessions.verifiers_agent import ARGS_VAR, ENV_VAR, export_dataset, load_env
from replay.format import dump_path
from replay.reader import read_dump

pytest.importorskip("verifiers", reason="the `verifiers` extra (in `dev`) is not installed")

ROLLOUTS = 2
BATCH, N = 4, 2


def _train(tiny_model_dir: Path, run_dir: Path, env_id: str, agent: str,
           env_args: dict[str, Any] | None = None) -> Path:
    data = run_dir / "train.jsonl"
    export_dataset(load_env(env_id, env_args), data)
    config = parse_config([
        "--hf-checkpoint", str(tiny_model_dir), "--prompt-data", str(data),
        "--input-key", "prompt", "--label-key", "label", "--metadata-key", "metadata", "--rollout-shuffle",
        "--custom-generate-function-path", "miles.rollout.generate_hub.agentic_tool_call.generate",
        "--custom-agent-function-path", agent,
        "--custom-rm-path", "coordinator.sessions.verifiers_agent:reward",
        "--use-session-server", "--sglang-api-key", "verifiers-key",
        "--rollout-batch-size", str(BATCH), "--n-samples-per-prompt", str(N), "--num-rollout", str(ROLLOUTS),
        "--rollout-max-response-len", "3", "--lr", "0.003",
        "--rollout-num-engines", "1", "--actor-num-gpus-per-node", "1",
        "--save-debug-rollout-data", str(run_dir / "dumps" / "{rollout_id}.rld"),
        "--run-dir", str(run_dir), "--no-progress",
    ])
    summary = anyio.run(run_training, config)
    assert summary["rollouts"] == ROLLOUTS and summary["train_steps"] == ROLLOUTS
    return run_dir


# Any lowercase letter calls the tool too, so the untrained model makes calls and most samples have two turns.
CALL = "[=a-z]"


@pytest.fixture(scope="module")
def tool_run(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    before = {name: os.environ.get(name) for name in (ENV_VAR, ARGS_VAR)}
    os.environ[ENV_VAR] = "examples.verifiers_env.calculator_env"
    os.environ[ARGS_VAR] = json.dumps({"call": CALL})
    try:
        yield _train(tiny_model_dir, tmp_path_factory.mktemp("vf_tool"), "examples.verifiers_env.calculator_env",
                     "coordinator.sessions.verifiers_agent.run_agent", {"call": CALL})
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@pytest.fixture(scope="module")
def single_run(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _train(tiny_model_dir, tmp_path_factory.mktemp("vf_single"), "examples.verifiers_env.echo_env",
                  "examples.verifiers_env.agents.run_echo")


def _samples(run_dir: Path) -> list[Any]:
    template = str(run_dir / "dumps" / "{rollout_id}.rld")
    samples = [s for r in range(ROLLOUTS) for s in read_dump(dump_path(template, r)).samples]
    assert len(samples) == ROLLOUTS * BATCH * N
    return samples


def _segments(sample: Any) -> tuple[list[list[int]], list[list[int]]]:
    """The response's runs of trained (mask 1) and untrained (mask 0) tokens, in order."""
    response = sample.tokens[len(sample.tokens) - sample.response_length:]
    trained: list[list[int]] = []
    between: list[list[int]] = []
    previous = None
    for token, mask in zip(response, sample.loss_mask, strict=True):
        target = trained if mask else between
        if mask != previous:
            target.append([])
        target[-1].append(token)
        previous = mask
    return trained, between


def _first_digit(text: str) -> str:
    return next((char for char in text if char.isdigit()), "")


def _check_mask_and_logprobs(sample: Any) -> None:
    assert sample.loss_mask[0] == 1  # the response starts at the first generated token
    for logprob, mask in zip(sample.rollout_log_probs, sample.loss_mask, strict=True):
        assert (logprob <= 0.0) if mask else (logprob == 0.0)
    assert sum(sample.loss_mask) <= 3 * sample.metadata["session_turns"]  # at most max_tokens per turn


def test_tool_env_samples_hold_every_turn_and_the_rubric_reward(tool_run: Path, tiny_model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    samples = _samples(tool_run)
    called = 0
    for sample in samples:
        metrics = sample.metadata["verifiers_metrics"]
        assert sample.metadata["session_turns"] == metrics["num_turns"]  # every turn verifiers ran is here
        trained, between = _segments(sample)
        assert len(trained) == metrics["num_turns"]  # one run of generated tokens per turn
        _check_mask_and_logprobs(sample)
        texts = [tokenizer.decode(segment) for segment in trained]
        if metrics["num_turns"] == 2:  # the first turn called the tool; its output sits untrained between
            called += 1
            assert re.fullmatch(CALL, texts[0][-1]) and metrics["tool_calls"] == 1.0
            total = sum(int(part) for part in sample.prompt[-1]["content"].split("+"))
            assert str(total) in tokenizer.decode(between[-1])
        else:
            assert metrics["tool_calls"] == 0.0 and not (texts[0] and re.fullmatch(CALL, texts[0][-1]))
        expected = float(_first_digit(texts[-1]) == sample.label)
        assert sample.metadata["reward"] == expected == sample.reward  # the rubric's reward, trained on
    assert called >= len(samples) // 4  # the run exercised the tool (letters call it)


def test_single_turn_env_through_the_generic_agent(single_run: Path, tiny_model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    for sample in _samples(single_run):
        assert sample.metadata["session_turns"] == sample.metadata["verifiers_metrics"]["num_turns"] == 1
        trained, between = _segments(sample)
        assert len(trained) == 1 and not between  # one turn: every response token is the model's
        _check_mask_and_logprobs(sample)
        expected = float(_first_digit(tokenizer.decode(trained[0])) == sample.label)
        assert sample.metadata["reward"] == expected == sample.reward


@pytest.mark.parametrize("run", ["tool_run", "single_run"])
def test_training_logprobs_match_the_engine(run: str, request: pytest.FixtureRequest) -> None:
    rows = read_metrics(request.getfixturevalue(run) / "metrics.jsonl")
    assert len(rows) == ROLLOUTS
    assert max(row["train/train_rollout_logprob_abs_diff_max"] for row in rows) <= 1e-4
