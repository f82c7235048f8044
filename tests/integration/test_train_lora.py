"""LoRA end to end: generate → train the adapters → sync merged weights, on real CPU engines and torchrun ranks.

One generating LoRA run (module fixture, distributed weight sync) feeds the checks: the reward rises, the
engines' logprobs match training's after every sync (they serve the merged weights), the checkpoint holds the
adapters and their optimizer state only, a colocated resume (disk snapshots in tmpfs) from it continues with
the same losses, and its dumps replay with no engine on one rank that train FT restarts mid-run (the restarted
rank gets its adapters back).

The model is the tiny one with its output head untied and adapted too: with the head tied to the frozen
embeddings, adapters on the seven projections cannot move this 64-wide model's logits far enough to learn the
task in 12 rollouts (its reward stays flat, measured), whereas the full model trains the embeddings too.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import psutil
import pytest

from coordinator.config import parse_config
from coordinator.observe.progress import read_metrics
from coordinator.run import run_training
from coordinator.services import Services
from tests.support.processes import alive
from tests.support.waiting import wait_until_sync
from workers.train_rank.checkpoint import ENV_DRILL_PAUSE, resolve_checkpoint
from workers.train_rank.checkpoint_files import verify_checkpoint

ROLLOUTS = 9
TARGETS = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj,lm_head"
COMMON = ["--prompt-data", "builtin:first_digit", "--rollout-batch-size", "32", "--n-samples-per-prompt", "8",
          "--rollout-max-response-len", "4", "--rollout-shuffle", "--lr", "1e-2", "--clip-grad", "1.0",
          "--actor-num-gpus-per-node", "2", "--no-progress",
          "--lora-rank", "8", "--lora-alpha", "16", "--target-modules", TARGETS]


def config_for(model: Path, run_dir: Path, *flags: str) -> Any:
    return parse_config(["--hf-checkpoint", str(model), "--run-dir", str(run_dir), *COMMON, *flags])


def losses(run_dir: Path) -> list[float]:
    return [row["train/loss"] for row in read_metrics(run_dir / "metrics.jsonl")]


@pytest.fixture(scope="module")
def untied_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`rayless make-tiny-model --untied-head`'s model (docs/lora.md's recipe)."""
    from workers.tiny_model import TinyModelSpec, build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("untied-model"), TinyModelSpec(untied_head=True))


@pytest.fixture(scope="module")
def lora_run(untied_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("lora")
    config = config_for(untied_model, run_dir, "--rollout-num-engines", "2", "--num-rollout", str(ROLLOUTS),
                        "--update-weight-transfer-mode", "distributed",
                        "--save-debug-rollout-data", str(run_dir / "dumps" / "{rollout_id}.rld"),
                        "--save", str(run_dir / "ckpt"), "--save-interval", "6",
                        "--save-hf", str(run_dir / "hf" / "{rollout_id}"))
    summary = anyio.run(run_training, config)
    assert summary["rollouts"] == ROLLOUTS and summary["train_steps"] == ROLLOUTS
    return run_dir


def test_lora_learns_and_the_engines_serve_the_merged_weights(lora_run: Path) -> None:
    rows = read_metrics(lora_run / "metrics.jsonl")
    rewards = [row["rollout/reward_mean"] for row in rows]
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    assert last >= 2 * first, rewards
    assert [row["weight_version"] for row in rows] == [str(i + 1) for i in range(ROLLOUTS)]
    # every rollout after the first ran on merged weights broadcast to the engines after a step
    diffs = [row["train/train_rollout_logprob_abs_diff_max"] for row in rows]
    assert max(diffs) <= 1e-4, diffs
    assert all(row["sync/engines"] == 2 for row in rows)


def test_the_checkpoint_holds_the_adapters_and_their_optimizer_state(lora_run: Path) -> None:
    from safetensors.torch import load_file
    from torch.distributed.checkpoint import FileSystemReader

    checkpoint = lora_run / "ckpt" / "rollout_5"
    keys = list(FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata)
    model_keys = [key for key in keys if key.startswith("model.")]
    optim_keys = [key for key in keys if key.startswith("optim.state.")]
    # 2 layers × 7 projections + lm_head, A and B each; nothing of the frozen base
    assert len(model_keys) == 2 * (2 * 7 + 1) and all(".lora_" in key for key in model_keys), model_keys
    assert {key.rsplit(".", 1)[-1] for key in optim_keys} >= {"exp_avg", "exp_avg_sq"}
    assert all(".lora_" in key for key in optim_keys)
    adapter = load_file(str(checkpoint / "adapter" / "adapter_model.safetensors"))
    assert len(adapter) == len(model_keys)
    assert any(tensor.abs().sum() > 0 for name, tensor in adapter.items() if ".lora_B." in name)  # trained


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")  # rayless export's dcp.load
def test_save_hf_holds_the_merged_model_and_the_adapter_and_export_gives_the_same(lora_run: Path,
                                                                                 untied_model: Path,
                                                                                 tmp_path: Path) -> None:
    """--save-hf of a LoRA run (rollouts 5 and 8): the merged weights transformers loads and generates from, the
    adapter in PEFT format in adapter/, equal to the checkpoint's (the trainer's); the merged weights are the base
    plus alpha/rank · B·A of that adapter, computed here from the files; `rayless export` of the checkpoint (the
    adapters on the base it records) gives the same merged weights and the same adapter."""
    from safetensors.torch import load_file

    from coordinator.cli import main as rayless
    from tests.support.hf_dirs import file_weights, loads_and_generates, max_difference

    assert sorted(path.name for path in (lora_run / "hf").iterdir()) == ["5", "8"]
    for rollout_id in (5, 8):
        saved, out = lora_run / "hf" / str(rollout_id), tmp_path / str(rollout_id)
        assert rayless(["export", str(lora_run / "ckpt" / f"rollout_{rollout_id}"), str(out)]) == 0
        weights = file_weights(saved)
        assert not any(".lora_" in name or "base_layer" in name for name in weights)
        assert max_difference(file_weights(out), weights) <= 1e-6
        for directory in (saved, out):
            loaded = loads_and_generates(directory)
            assert max_difference({name: loaded[name] for name in weights}, weights) <= 1e-6
            adapter = load_file(str(directory / "adapter" / "adapter_model.safetensors"))
            trained = load_file(str(lora_run / "ckpt" / f"rollout_{rollout_id}" / "adapter" /
                                    "adapter_model.safetensors"))
            assert max_difference(adapter, trained) == 0
            assert (directory / "adapter" / "adapter_config.json").is_file()
        base, expected = file_weights(untied_model), {}
        for key, a in trained.items():
            if ".lora_A." in key:  # base_model.model.<module>.lora_A.weight
                module = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
                b = trained[key.replace(".lora_A.", ".lora_B.")]
                expected[f"{module}.weight"] = base[f"{module}.weight"] + (16 / 8) * (b @ a)
        assert len(expected) == 2 * 7 + 1
        assert max_difference(weights, {**base, **expected}) <= 1e-6
    merged_5, merged_8 = file_weights(lora_run / "hf" / "5"), file_weights(lora_run / "hf" / "8")
    assert max_difference(merged_8, merged_5) > 1e-4  # the adapters trained on between the two saves


async def test_a_colocated_resume_continues_with_the_same_losses(lora_run: Path, untied_model: Path,
                                                                  tmp_path: Path) -> None:
    run_dir = tmp_path / "resumed"
    run_dir.mkdir()
    shutil.copy(lora_run / "metrics.jsonl", run_dir / "metrics.jsonl")
    config = config_for(untied_model, run_dir, "--rollout-num-engines", "1", "--num-rollout", "8", "--colocate",
                        "--load", str(lora_run / "ckpt" / "rollout_5"))
    summary = await run_training(config)
    assert summary["rollouts"] == 2  # rollouts 6 and 7
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [row["step"] for row in rows] == list(range(8))
    # the engines (colocated: merged weights by tmpfs snapshots) serve what the resumed adapters compute
    assert max(row["train/train_rollout_logprob_abs_diff_max"] for row in rows[6:]) <= 1e-4
    assert losses(run_dir)[6:] == pytest.approx(losses(lora_run)[6:8], abs=1e-6)


class RankKiller:
    """Hook: SIGKILL rank 0 right after the step of `at_rollout` (a crash between steps)."""

    def __init__(self, services: Services, at_rollout: int) -> None:
        self.services = services
        self.at_rollout = at_rollout
        self.killed: list[int] = []

    async def after_step(self, rollout_id: int, weight_version: str) -> None:
        if rollout_id == self.at_rollout and not self.killed:
            pid = self.services.train_group.ranks[0].pid
            os.kill(pid, signal.SIGKILL)
            self.killed.append(pid)


async def children_while(run: Any) -> set[str]:
    """The command lines of every child process seen while `run()` goes on."""
    seen: set[str] = set()

    async def watch() -> None:
        while True:
            for child in psutil.Process().children(recursive=True):
                try:
                    seen.add(" ".join(child.cmdline()))
                except psutil.Error:
                    pass
            await anyio.sleep(0.2)

    async with anyio.create_task_group() as group:
        group.start_soon(watch)
        await run()
        group.cancel_scope.cancel()
    return seen


async def test_a_replay_whose_rank_train_ft_restarts_retrains_the_same_adapters(
        lora_run: Path, untied_model: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Replay (no engine) on one rank, killed after its second step: the restarted rank gets the adapters of
    that step back from the checkpoint, and every step, the re-sent one included, computes the logprobs the
    generating run's engines computed for those samples (fresh adapters would differ by both updates)."""
    caplog.set_level(logging.WARNING, logger="rayless")
    template = str(lora_run / "dumps" / "{rollout_id}.rld")
    config = config_for(untied_model, tmp_path / "run", "--load-debug-rollout-data", template, "--num-rollout", "3",
                        "--actor-num-gpus-per-node", "1", "--save", str(tmp_path / "ckpt"), "--save-interval", "1",
                        "--use-fault-tolerance", "--ft-components", "train", "--max-restarts", "1")
    killers: list[RankKiller] = []
    summaries: list[dict[str, Any]] = []

    def hooks(services: Services) -> list[Any]:
        killers.append(RankKiller(services, at_rollout=1))
        return killers

    async def run() -> None:
        summaries.append(await run_training(config, extra_hooks=hooks))

    children = await children_while(run)
    assert not [c for c in children if "workers.engine" in c or "sglang" in c], children
    summary = summaries[0]
    assert killers[0].killed and summary["train_steps"] == 3 and summary["train_recoveries"] == 1
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert rows[1]["train/grad_norm"] > 0  # the adapters moved before the kill
    assert max(row["train/train_rollout_logprob_abs_diff_max"] for row in rows) <= 1e-4
    assert any("ranks are back from checkpoint" in r.getMessage() and "rollout_1" in r.getMessage()
               for r in caplog.records)
    # the replayed batches are the generated ones: one rank's losses are the two ranks' (to float rounding)
    assert losses(tmp_path / "run") == pytest.approx(losses(lora_run)[:3], abs=1e-5)


DRILL_PHASES = (("shards", 1), ("extra", 2), ("complete", 3), ("publish", 3))


def test_a_coordinator_sigkilled_at_every_phase_of_a_lora_save_resumes_with_every_row_once(
        lora_run: Path, untied_model: Path, tmp_path: Path) -> None:
    """Issue 41's drill, for real: a replay (one rank, no engine) saving every rollout; the coordinator is
    SIGKILLed while rank 0 sits at each phase of a LoRA save in turn — DCP shards and adapter files written,
    extra.json written, the manifest written but unpublished, half-way through publishing (the rank waits there
    by `RAYLESS_DRILL_SAVE_PAUSE`, so the kill lands at that phase) — then resumed each time with `--load`.
    `latest` always names a checkpoint that verifies, and the finished run's metrics hold every step once, with
    the losses of an uninterrupted run."""
    rollouts = 4
    save, run_dir = tmp_path / "ckpt", tmp_path / "run"
    command = [sys.executable, "-m", "coordinator.cli", "train", "--hf-checkpoint", str(untied_model),
               "--run-dir", str(run_dir), *COMMON, "--load-debug-rollout-data",
               str(lora_run / "dumps" / "{rollout_id}.rld"), "--num-rollout", str(rollouts),
               "--actor-num-gpus-per-node", "1", "--save", str(save), "--save-interval", "1"]
    for number, (phase, rollout_id) in enumerate(DRILL_PHASES):
        marker = tmp_path / f"paused-{number}"
        env = {**os.environ, ENV_DRILL_PAUSE: f"{phase}:{rollout_id}:{marker}"}
        load = ["--load", str(save)] if number else []
        with (tmp_path / f"stderr-{number}").open("wb") as err:
            proc = subprocess.Popen([*command, *load], env=env, stdout=subprocess.DEVNULL, stderr=err)
        try:
            wait_until_sync(lambda marker=marker, proc=proc: marker.exists() or proc.poll() is not None,
                            timeout=240, interval=0.05,
                            what=f"rank 0 pausing at the {phase} phase of rollout {rollout_id}'s save")
            assert marker.exists(), (tmp_path / f"stderr-{number}").read_text()[-3000:]
            children = psutil.Process(proc.pid).children(recursive=True)
            os.kill(proc.pid, signal.SIGKILL)  # the coordinator alone: its children end by themselves
            proc.wait(timeout=30)
            wait_until_sync(lambda children=children: alive(children), until=lambda left: not left, timeout=60,
                            interval=0.1, what="the run's children ending")
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        latest = resolve_checkpoint(save)
        assert latest is not None, f"no complete checkpoint after the kill at {phase}"
        verify_checkpoint(latest)  # what `latest` names is complete, whatever the phase
        steps = [row["step"] for row in read_metrics(run_dir / "metrics.jsonl")]
        assert steps == sorted(set(steps)), steps  # never a step twice, even before the resume rewrites
        assert max(steps) >= int(latest.name.removeprefix("rollout_")), (steps, latest)  # its row is there
    done = subprocess.run([*command, "--load", str(save)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [row["step"] for row in rows] == list(range(rollouts))
    assert losses(run_dir) == pytest.approx(losses(lora_run)[:rollouts], abs=1e-5)
    assert resolve_checkpoint(save) == save / f"rollout_{rollouts - 1}"
