"""The shipped tool-use example (examples/calculator) as a whole run: its slime-shaped generate and reward
functions on real CPU engines (through the coordinator's hook endpoint) and torchrun ranks.

One generating run (module fixture) feeds the checks: the reward at least doubles from the first three rollouts
to the last three (at a higher lr than the example's; its full measurement is in docs/hooks.md); the
calculator's tokens are in the trained samples with loss mask 0 and logprob 0.0, yet the trainer's logprobs
match the engines' within 1e-4 on every rollout — so the comparison (and the loss) covers exactly the model's
tokens; the dumps hold the multi-turn samples and replay to the run's own losses, bit for bit (two trainings
of the same samples, identical).
"""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest

from coordinator.config import parse_config
from coordinator.observe.progress import read_metrics
from coordinator.run import run_training
from replay.format import dump_path
from replay.reader import read_dump

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "calculator"
# The example's lr (0.003) doubles the reward in about 12 rollouts; at 0.02 it grows ~6x within 6 (measured:
# 0.014 over rollouts 0-2, 0.090 over 3-5), so the run is half as long and the margin wider.
ROLLOUTS = 6
LR = "0.02"
REPLAYED = 3  # rollouts replayed from the dumps


def config_for(model: Path, run_dir: Path, *flags: str):
    """The example's own config file (the command line wins: the data path, the run directory)."""
    return parse_config(["--hf-checkpoint", str(model), "--config", str(EXAMPLE / "train.yaml"),
                         "--prompt-data", str(EXAMPLE / "train.jsonl"), "--run-dir", str(run_dir), "--no-progress",
                         *flags])


def replay_config(model: Path, run_dir: Path, template: str, rollouts: int):
    """The example's training flags, its engine and hook flags left out: a replay starts no engine."""
    return parse_config(["--hf-checkpoint", str(model), "--prompt-data", str(EXAMPLE / "train.jsonl"),
                         "--input-key", "prompt", "--label-key", "label", "--rollout-batch-size", "32",
                         "--n-samples-per-prompt", "8", "--lr", LR, "--clip-grad", "1.0",
                         "--actor-num-gpus-per-node", "1", "--load-debug-rollout-data", template,
                         "--num-rollout", str(rollouts), "--run-dir", str(run_dir), "--no-progress"])


@pytest.fixture(scope="module")
def calculator_run(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("calculator")
    config = config_for(tiny_model_dir, run_dir, "--num-rollout", str(ROLLOUTS), "--lr", LR, "--log-multi-turn",
                        "--save-debug-rollout-data", str(run_dir / "dumps" / "{rollout_id}.rld"))
    summary = anyio.run(run_training, config)
    assert summary["rollouts"] == ROLLOUTS and summary["train_steps"] == ROLLOUTS
    return run_dir


def test_the_calculator_example_learns_to_use_its_tool(calculator_run: Path) -> None:
    rows = read_metrics(calculator_run / "metrics.jsonl")
    rewards = [row["rollout/reward_mean"] for row in rows]
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    assert last >= 2 * first, rewards
    # Model turns per sample: 1 (answered at once) or 2 (called the calculator, then answered).
    turns = [row["multi_turn/multi_turn_metric/round_number_mean"] for row in rows]
    assert all(1.0 <= t <= 2.0 for t in turns) and max(turns) > 1.0, turns


def test_tool_tokens_are_masked_out_of_the_loss_and_the_logprob_comparison(calculator_run: Path,
                                                                           tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    samples = [s for r in range(ROLLOUTS) for s in read_dump(dump_path(str(calculator_run / "dumps" /
                                                                              "{rollout_id}.rld"), r)).samples]
    called = [s for s in samples if s.is_multi_turn]
    assert len(called) > len(samples) / 2  # most samples asked the calculator
    for sample in called:
        # the call token, then the tool's one token (loss mask 0, logprob 0.0), then the answer (≤ 2 tokens)
        assert sample.loss_mask[:2] == [1, 0] and sample.loss_mask[2:] in ([1], [1, 1]), sample.loss_mask
        assert sample.rollout_log_probs[1] == 0.0
        a, b = sample.prompt.split("+")
        assert tokenizer.decode(sample.response_tokens[1:2]) == str(int(a) + int(b))  # the calculator's result
    rows = read_metrics(calculator_run / "metrics.jsonl")
    # Had the tool tokens (logprob 0.0 recorded) been compared, the difference would be their model logprob.
    assert max(row["train/train_rollout_logprob_abs_diff_max"] for row in rows) <= 1e-4
    # Only the model's tokens are loss tokens: the tool's are not counted.
    for rollout, row in enumerate(rows):
        dumped = read_dump(dump_path(str(calculator_run / "dumps" / "{rollout_id}.rld"), rollout)).samples
        assert row["train/loss_tokens"] == sum(sum(s.loss_mask) for s in dumped)
        assert row["train/loss_tokens"] < sum(s.response_length for s in dumped) or not any(
            s.is_multi_turn for s in dumped)


async def test_multi_turn_dumps_replay_to_identical_losses(calculator_run: Path, tiny_model_dir: Path,
                                                          tmp_path: Path) -> None:
    template = str(calculator_run / "dumps" / "{rollout_id}.rld")
    dump = read_dump(dump_path(template, 0))
    assert dump.header.format_version == 2 and any(sample.is_multi_turn for sample in dump.samples)
    run_dir = tmp_path / "replay"
    summary = await run_training(replay_config(tiny_model_dir, run_dir, template, REPLAYED))
    assert summary["train_steps"] == REPLAYED
    replayed = [row["train/loss"] for row in read_metrics(run_dir / "metrics.jsonl")]
    generated = [row["train/loss"] for row in read_metrics(calculator_run / "metrics.jsonl")]
    # Two trainings on the same samples from the same weights (the run's own, then the replay's), each
    # step after the first on the weights the previous step left: identical losses, bit for bit.
    assert replayed == generated[:REPLAYED]
