"""SFT as slime's scripts run it, through `rayless train` as a process: chat data, slime's SFT rollout path,
`--loss-type sft_loss`, `--num-epoch`, torchrun ranks on gloo, no engine. The tiny model learns a fixed
mapping (fruit → colour, asked in two-turn chats): the loss falls clearly, `--num-epoch` sets the number of
rollouts from the data, and the model saved by `--save-hf` (and exported from the checkpoint) answers every
question of the data greedily.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from coordinator.observe.progress import read_metrics

MAPPING = {"apple": "red", "lime": "green", "plum": "purple", "banana": "yellow"}
SYSTEM = {"role": "system", "content": "Name the colour."}


def write_chats(path: Path) -> Path:
    """Eight two-turn chats: every fruit asked first and second once (so both assistant turns are trained)."""
    fruits = list(MAPPING)
    lines = []
    for shift in (1, 2):
        for i, first in enumerate(fruits):
            second = fruits[(i + shift) % len(fruits)]
            messages = [SYSTEM, {"role": "user", "content": first}, {"role": "assistant", "content": MAPPING[first]},
                        {"role": "user", "content": second}, {"role": "assistant", "content": MAPPING[second]}]
            lines.append(json.dumps({"messages": messages}))
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def sft_run(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("sft")
    data = write_chats(root / "chats.jsonl")
    run_dir = root / "run"
    # slime's SFT_ARGS (scripts/run-qwen3-4B-base-sft.sh), with a tiny model's sizes
    argv = ["--hf-checkpoint", str(tiny_model_dir), "--run-dir", str(run_dir), "--no-progress",
            "--rollout-function-path", "slime.rollout.sft_rollout.generate_rollout", "--prompt-data", str(data),
            "--input-key", "messages", "--rollout-shuffle", "--num-epoch", "50", "--rollout-batch-size", "4",
            "--global-batch-size", "4", "--loss-type", "sft_loss", "--calculate-per-token-loss",
            "--disable-compute-advantages-and-returns", "--debug-train-only", "--lr", "1e-2", "--lr-decay-style",
            "cosine", "--min-lr", "5e-3", "--lr-warmup-fraction", "0.05", "--actor-num-gpus-per-node", "2",
            "--save", str(root / "ckpt"), "--save-interval", "1000", "--save-hf", str(root / "hf")]
    done = subprocess.run([sys.executable, "-m", "coordinator.cli", "train", *argv], capture_output=True, text=True,
                          timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    (root / "stderr.txt").write_text(done.stderr)
    return root


def test_the_loss_falls_over_epochs_and_num_epoch_sets_the_rollouts(sft_run: Path) -> None:
    rows = read_metrics(sft_run / "run" / "metrics.jsonl")
    summary = json.loads((sft_run / "run" / "summary.json").read_text())
    assert summary["rollouts"] == 50 * (8 // 4) == len(rows)  # slime: epochs × (records // rollout batch size)
    losses = [row["train/loss"] for row in rows]
    first, last = sum(losses[:2]) / 2, sum(losses[-2:]) / 2
    assert last < 0.25 * first, losses
    # the trained tokens are the assistant turns only: two answers and their end markers per chat
    per_chat = [len(MAPPING[fruit]) + 2 for fruit in MAPPING]
    assert all(row["train/loss_tokens"] <= 4 * 2 * max(per_chat) for row in rows)
    assert all(row["train/loss_tokens"] >= 4 * 2 * min(per_chat) for row in rows)
    assert json.loads((sft_run / "run" / "config.json").read_text())["num_rollout"] == 100
    # the schedule spans the rollouts --num-epoch gave: warm-up, the peak, then cosine down to --min-lr
    lrs = [row["train/lr"] for row in rows]
    assert lrs[0] < max(lrs) == pytest.approx(1e-2, rel=0.05) and lrs[-1] == pytest.approx(5e-3, rel=0.05)


def test_no_engine_was_started(sft_run: Path) -> None:
    """The plan (every process the run launches) holds the ranks only; no engine log, monitor or eval fleet."""
    plan = (sft_run / "run" / "plan.txt").read_text()
    assert "workers.train_rank" in plan
    assert "workers.engine" not in plan and "sglang.launch_server" not in plan and "sglang_router" not in plan
    summary = json.loads((sft_run / "run" / "summary.json").read_text())
    assert summary["ft"]["monitors"] == [] and summary["ft"]["evals"] == []
    logs = sorted(path.name for path in (sft_run / "run").glob("*.log"))
    assert logs == ["coordinator.log", "train_ranks.log"], logs


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")  # dcp.load in one process
def test_the_saved_model_answers_the_mapping_and_export_gives_the_same(sft_run: Path, tmp_path: Path) -> None:
    """--save-hf (no {rollout_id}: one directory, written at the last save) is the model itself: transformers
    loads it with its own tokenizer and it answers every question; `rayless export` of the checkpoint (the
    trainer's weights) gives the same weights, which answer the same."""
    from coordinator.cli import main as rayless
    from tests.support.hf_dirs import file_weights, max_difference

    saved, out = sft_run / "hf", tmp_path / "out"
    assert rayless(["export", str(sft_run / "ckpt"), str(out)]) == 0
    assert max_difference(file_weights(out), file_weights(saved)) <= 1e-6
    for directory in (saved, out):
        answer_the_mapping(directory)


def answer_the_mapping(directory: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(directory)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    model.eval()
    for fruit, colour in MAPPING.items():
        prompt = tokenizer.apply_chat_template([SYSTEM, {"role": "user", "content": fruit}], tokenize=False,
                                               add_generation_prompt=True)
        ids = tokenizer(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=len(colour) + 1, do_sample=False)
        assert tokenizer.decode(out[0, ids.shape[1]:]) == colour + "<|im_end|>", fruit
