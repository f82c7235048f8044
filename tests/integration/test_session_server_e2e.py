"""A miles-style agent on the `openai` SDK trains through `--use-session-server`: a real run (CPU engine,
torchrun ranks), miles' agentic generate path resolving to ours.

Checked on every dumped sample: it holds every turn the agent saw up to the first that did not end in `stop`
(the tokens the engine generated, in order, and the tool output between them); the loss mask is 1 exactly on
the generated tokens; the rollout logprobs there are the ones the agent received (0.0 elsewhere); the agent's
returned dict reached the sample's metadata and the custom reward (the run has an API key: the agent got it and
the session server asked for it); and the trainer's logprobs match the engine's within 1e-4 on every rollout.
That multi-turn dumps (tool tokens under loss mask 0) replay to the generating run's losses is checked, on
the same replay path and bit for bit, by tests/integration/test_hooks_e2e.py. No process of the keyed run shows
the key on its command line (`ps` shows command lines to every user): each one's is read at every step.
"""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import pytest
from transformers import AutoTokenizer

from coordinator.config import parse_config
from coordinator.observe.progress import read_metrics
from coordinator.run import run_training
from replay.format import dump_path
from replay.reader import read_dump
from tests.support.command_lines import CommandLines

ROLLOUTS = 2
KEY = "session-e2e-key"


def _data(path: Path) -> Path:
    rows = [{"prompt": [{"role": "user", "content": f"{a}+{b}"}], "label": str(a + b)}
            for a in range(3) for b in range(3)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.fixture(scope="module")
def session_run(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    run_dir = tmp_path_factory.mktemp("sessions")
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    # Stop on any digit or lowercase letter: most turns end by `stop`, so most samples have two turns.
    stops = [str(i) for i in tokenizer.convert_tokens_to_ids(list("0123456789abcdefghijklmnopqrstuvwxyz"))]
    config = parse_config([
        "--hf-checkpoint", str(tiny_model_dir), "--prompt-data", str(_data(run_dir / "train.jsonl")),
        "--input-key", "prompt", "--label-key", "label",
        "--custom-generate-function-path", "miles.rollout.generate_hub.agentic_tool_call.generate",
        "--custom-agent-function-path", "tests.support.session_agent.run_agent",
        "--custom-rm-path", "tests.support.session_agent.reward",
        "--use-session-server", "--tito-model", "default", "--sglang-api-key", KEY,
        "--rollout-batch-size", "4", "--n-samples-per-prompt", "2", "--num-rollout", str(ROLLOUTS),
        "--rollout-max-response-len", "6", "--rollout-stop-token-ids", *stops,
        "--lr", "0.003", "--rollout-num-engines", "1", "--actor-num-gpus-per-node", "1",
        "--save-debug-rollout-data", str(run_dir / "dumps" / "{rollout_id}.rld"),
        "--run-dir", str(run_dir), "--no-progress",
    ])
    lines = CommandLines()
    summary = anyio.run(partial(run_training, config, extra_hooks=lambda _services: [lines]))
    assert summary["rollouts"] == ROLLOUTS and summary["train_steps"] == ROLLOUTS
    # every child of the keyed run, read while it ran: the engine (its key in a 0600 --config file), torchrun
    # and its rank; none shows the key
    assert lines.holding("-m workers.engine") and lines.holding("workers.train_rank"), lines.seen
    assert not lines.holding(KEY), lines.holding(KEY)
    assert all("--config " in line and "--api-key" not in line for line in lines.holding("-m workers.engine"))
    return run_dir, tokenizer


def _samples(run_dir: Path) -> list[Any]:
    template = str(run_dir / "dumps" / "{rollout_id}.rld")
    return [s for r in range(ROLLOUTS) for s in read_dump(dump_path(template, r)).samples]


def test_every_turn_is_in_the_sample_with_its_mask_and_logprobs(session_run: tuple[Path, Any]) -> None:
    run_dir, tokenizer = session_run
    samples = _samples(run_dir)
    assert len(samples) == ROLLOUTS * 4 * 2
    two_turns = 0
    for sample in samples:
        received = sample.metadata["received"]
        kept = []
        for turn in received:  # the first turn not ending in stop ends the trajectory
            kept.append(turn)
            if turn["finish"] != "stop":
                break
        assert sample.metadata["session_turns"] == len(kept)
        two_turns += len(kept) == 2
        response = sample.tokens[len(sample.tokens) - sample.response_length:]
        trained = [token for token, mask in zip(response, sample.loss_mask, strict=True) if mask]
        assert sum(sample.loss_mask) == sum(len(turn["logprobs"]) for turn in kept)
        assert trained[:len(kept[0]["ids"])] == kept[0]["ids"]  # the first turn's answer carried its ids
        if len(kept) == 2:  # the streamed turn: its logprobs' token texts (one character each) name its ids
            assert trained[len(kept[0]["ids"]):] == tokenizer.convert_tokens_to_ids(kept[1]["tokens"])
        logprobs = [lp for lp, mask in zip(sample.rollout_log_probs, sample.loss_mask, strict=True) if mask]
        assert logprobs == [lp for turn in kept for lp in turn["logprobs"]]
        assert all(lp == 0.0 for lp, mask in zip(sample.rollout_log_probs, sample.loss_mask, strict=True) if not mask)
        # The first generated token starts the response: the prompt (the chat template's) is not in it.
        assert sample.loss_mask[0] == 1
        if len(kept) == 2:
            between = [t for t, mask in zip(response, sample.loss_mask, strict=True) if not mask]
            assert sample.metadata["tool_output"] in tokenizer.decode(between)  # the tool's message, untrained
        assert sample.reward == float(sample.metadata["tool_output"] in sample.metadata["answer"])
    assert two_turns >= len(samples) // 2  # the stops make most samples multi-turn


def test_training_logprobs_match_the_engine(session_run: tuple[Path, Any]) -> None:
    run_dir, _ = session_run
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert len(rows) == ROLLOUTS
    assert max(row["train/train_rollout_logprob_abs_diff_max"] for row in rows) <= 1e-4
