"""`rayless train --dry-run` through the real CLI, each run a process of its own (forked from a warm server):
the checks, the printed plan, the exit status, and that nothing is launched (no child process, no run directory, the launcher never imported)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.support.warm_cli import WarmCli


@pytest.fixture(scope="module")
def warm_cli(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WarmCli]:
    """Each dry run below is a child forked from one server that has imported the CLI's checks (transformers,
    torch) once; the child reports its own live children and whether the launcher was imported."""
    with WarmCli(tmp_path_factory.mktemp("warm-cli")) as warm:
        yield warm


@pytest.fixture
def run_cli(warm_cli: WarmCli) -> Callable[..., dict]:
    def run(*args: str, gpus: int | None = None, pythonpath: Path | None = None,
            extra_env: dict[str, str] | None = None) -> dict:
        env = dict(extra_env or {})
        if gpus is not None:
            env["RAYLESS_PLAN_GPU_COUNT"] = str(gpus)
        return warm_cli.run_probed(["train", *args], cwd=Path.cwd(), env=env,
                                   python_path=[pythonpath] if pythonpath is not None else [],
                                   unset=() if gpus is not None else ("RAYLESS_PLAN_GPU_COUNT",))
    return run


@pytest.fixture
def job(tiny_model_dir: Path, tmp_path: Path) -> list[str]:
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"question": f"{i} 7 1=", "answer": str(i)}) + "\n" for i in range(5)))
    return ["--hf-checkpoint", str(tiny_model_dir), "--prompt-data", str(data), "--input-key", "question",
            "--label-key", "answer", "--apply-chat-template", "--rm-type", "first_digit",
            "--rollout-batch-size", "4", "--n-samples-per-prompt", "2", "--num-rollout", "3",
            "--run-dir", str(tmp_path / "run"), "--save", str(tmp_path / "ckpt"), "--dry-run"]


def test_a_dry_run_of_an_8_gpu_plan_checks_everything_prints_the_plan_and_launches_nothing(
        run_cli: Callable[..., dict], job: list[str], tmp_path: Path) -> None:
    outcome = run_cli(*job, "--rollout-num-gpus", "4", "--rollout-num-gpus-per-engine", "2",
                      "--actor-num-gpus-per-node", "4", "--engine-backend", "sglang", "--sglang-api-key", "SENTINEL",
                      gpus=8)
    assert outcome["status"] == 0, outcome["stderr"]
    assert outcome["children"] == 0 and not outcome["launcher_imported"]
    assert not (tmp_path / "run").exists() and not (tmp_path / "ckpt").exists()
    out = outcome["stdout"]
    assert "all 5 record(s) hold input key 'question', label key 'answer'" in out
    assert "--apply-chat-template: the first prompt renders as:" in out and "0 7 1=" in out
    assert "tokenizer: " in out and f"--save {tmp_path / 'ckpt'}: writable" in out
    assert "--rollout-function-path coordinator.rollout.generate:DefaultRollout: class" in out
    assert "node 0: 8 GPUs (RAYLESS_PLAN_GPU_COUNT=8, injected for planning); this plan uses 8" in out
    assert "train-ranks  0-3" in out and "CUDA_VISIBLE_DEVICES=0,1,2,3" in out
    assert "--tp-size 2 --base-gpu-id 4" in out and "--tp-size 2 --base-gpu-id 6" in out
    assert "weight sync: disk" in out and "bucket size 512 MiB" in out
    assert "SENTINEL" not in out + outcome["stderr"] and "--config '<0600 file: api-key>'" in out
    assert "every check passed; nothing was launched" in out


def test_what_this_machine_lacks_is_a_warning_in_a_dry_run(run_cli: Callable[..., dict], job: list[str]) -> None:
    # 2 GPUs shown, 8 planned; and no sglang package here (the auto backend then plans our engine on CUDA).
    outcome = run_cli(*job, "--rollout-num-gpus", "4", "--actor-num-gpus-per-node", "4", gpus=2)
    assert outcome["status"] == 0, outcome["stderr"]
    assert "rayless train: warning: the placement plan needs 8 GPUs on this node but it shows 2" in outcome["stderr"]
    out = outcome["stdout"]
    assert "8 assumed for this plan" in out and "rollout-3" in out
    if "sglang is installed" not in out:
        assert "our engine on CUDA" in out and "--device cuda --base-gpu-id 0" in out
        assert "CUDA_VISIBLE_DEVICES=7" in out
    assert outcome["children"] == 0


def test_a_dry_run_reports_every_problem_it_finds_and_exits_2(run_cli: Callable[..., dict], job: list[str],
                                                              tmp_path: Path) -> None:
    hooks = tmp_path / "hooks_dry_run.py"
    hooks.write_text("def reward(sample, extra, more):\n    return 0.0\n")  # neither rayless' form nor slime's
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    flags = [flag for flag in job if flag != "--rm-type" and flag != "first_digit"]
    flags = [str(locked / "ckpt") if flag == str(tmp_path / "ckpt") else flag for flag in flags]
    flags[flags.index("answer")] = "solution"
    outcome = run_cli(*flags, "--rollout-num-engines", "1", "--custom-rm-path", "hooks_dry_run:reward",
                      pythonpath=tmp_path)
    assert outcome["status"] == 2 and outcome["children"] == 0
    err = outcome["stderr"]
    assert "key 'solution' (--label-key) is missing" in err
    assert "--custom-rm-path 'hooks_dry_run:reward': rayless calls it as reward(sample)" in err
    assert "but its signature is (sample, extra, more)" in err
    assert "--apply-chat-template" not in err  # the data's problem is reported once, by the data check
    if os.geteuid() != 0:  # root writes anywhere
        assert f"--save {locked / 'ckpt'}: cannot be written" in err
    assert "problem(s), see above; nothing was launched" in outcome["stdout"]


def test_a_launch_that_needs_more_gpus_than_the_node_shows_exits_2_before_launching(
        run_cli: Callable[..., dict], job: list[str]) -> None:
    flags = [flag for flag in job if flag != "--dry-run"]
    # More GPUs than any node has, so this holds on a GPU machine too.
    outcome = run_cli(*flags, "--rollout-num-gpus", "64", "--actor-num-gpus-per-node", "64",
                      "--global-batch-size", "64", "--rollout-batch-size", "32")
    assert outcome["status"] == 2 and outcome["children"] == 0 and not outcome["launcher_imported"]
    assert "rayless train: error: the placement plan needs 128 GPUs on this node but it shows" in outcome["stderr"]
    assert "--actor-num-gpus-per-node 64 (64 training ranks) + --rollout-num-gpus 64 (64 rollout engines) = 128" \
        in outcome["stderr"]
    injected = run_cli(*flags, "--rollout-num-engines", "1", gpus=8)
    assert injected["status"] == 2 and "unset it to launch" in injected["stderr"] and injected["children"] == 0


def test_a_dry_run_of_a_colocated_8_gpu_plan(run_cli: Callable[..., dict], job: list[str], tmp_path: Path) -> None:
    """Issue 12: engines on the ranks' GPUs (tp 1, then tp 2), the hand-over, and where snapshots go."""
    flags = [*job, "--colocate", "--actor-num-gpus-per-node", "8", "--rollout-batch-size", "8"]
    outcome = run_cli(*flags, "--rollout-num-gpus-per-engine", "1", "--engine-backend", "rayless", gpus=8)
    assert outcome["status"] == 0, outcome["stderr"]
    assert outcome["children"] == 0 and not (tmp_path / "run").exists()
    out = outcome["stdout"]
    print(out)
    assert "placement plan (policy colocate" in out and "this plan uses 8" in out
    assert "train-ranks  0-7 shared" in out
    for gpu in range(8):
        assert f"rollout-{gpu}    {gpu} shared" in out
    assert "engines release memory (weights, kv_cache, cuda_graph) → ranks bring parameters" in out
    assert "weight sync: disk" in out
    if Path("/dev/shm").is_dir():
        assert "snapshot under /dev/shm/rayless-" in out and "removed when the run ends" in out
    tp2 = run_cli(*flags, "--rollout-num-gpus-per-engine", "2", "--engine-backend", "sglang", gpus=8)
    assert tp2["status"] == 0, tp2["stderr"]
    out = tp2["stdout"]
    print(out)
    assert "--tp-size 2 --base-gpu-id 0" in out and "--tp-size 2 --base-gpu-id 6" in out
    assert out.count("--enable-memory-saver") == 4
    refused = run_cli(*flags, "--async-rollout", gpus=8)
    assert refused["status"] == 2 and "--colocate and --async-rollout" in refused["stderr"]


@pytest.mark.parametrize("node", [0, 1])
def test_a_dry_run_of_a_2_node_8_gpu_plan_shows_each_nodes_share(run_cli: Callable[..., dict], job: list[str],
                                                                 tmp_path: Path, node: int) -> None:
    token = "SENTINEL-token-0123456789abcdef"
    slurm = {"SLURM_NODEID": str(node), "SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "gpu-node[07-08]",
             "RAYLESS_CONTROL_TOKEN": token}
    outcome = run_cli(*job, "--actor-num-nodes", "2", "--actor-num-gpus-per-node", "4", "--rollout-num-gpus", "8",
                      "--rollout-num-gpus-per-engine", "2", "--engine-backend", "sglang", gpus=8, extra_env=slurm)
    assert outcome["status"] == 0, outcome["stderr"]
    assert outcome["children"] == 0 and not outcome["launcher_imported"] and not (tmp_path / "run").exists()
    out = outcome["stdout"]
    role = "the coordinator (node 0)" if node == 0 else "node 1, not the coordinator"
    assert f"nodes: 2; this is {role} (SLURM_NODEID={node}; node 0 from the first host of " \
           "SLURM_JOB_NODELIST=gpu-node[07-08], port 29500)" in out
    assert "rendezvous  torchrun c10d at gpu-node07:29500" in out
    assert "control     ranks dial gpu-node07:29501 (node 0 listens on 0.0.0.0:29501)" in out
    assert "registry    node 1 reports its engines to gpu-node07:29502" in out
    assert f"node {node} (this node): 4 training rank(s), 2 rollout engine(s)" in out
    assert f"node {node}: 8 GPUs (RAYLESS_PLAN_GPU_COUNT=8, injected for planning); this plan uses 8" in out
    engines = ("rollout-0", "rollout-1") if node == 0 else ("rollout-2", "rollout-3")
    assert f"{engines[0]}    4,5   cuda (sglang, tp 2)" in out and f"{engines[1]}    6,7   cuda (sglang, tp 2)" in out
    assert "train-ranks  0-3" in out and f"RAYLESS_NODE_RANK={node} TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in out
    assert f"--nnodes 2 --node-rank {node} --rdzv-backend c10d --rdzv-endpoint gpu-node07:29500 " \
           f"--rdzv-conf is_host={1 if node == 0 else 0}" in out
    assert f"train_ranks-node{node}.log" in out and "RAYLESS_CONTROL_TOKEN=***" in out
    assert token not in out + outcome["stderr"]
    if node == 1:  # its engines listen where node 0 reaches it; a login node has no route to gpu-node07
        assert "there is no route from here to node 0 (gpu-node07)" in outcome["stderr"]


def test_a_replays_dumps_are_found_and_counted_by_the_dry_run(run_cli: Callable[..., dict], tiny_model_dir: Path,
                                                              tmp_path: Path) -> None:
    """The dumps the template finds are listed; a template that finds none exits 2 naming it, with --num-rollout
    given too (the launch's count then reads nothing: the replay check is what finds it)."""
    from tests.support.replay_inputs import write_sample_dump

    for rollout_id in (0, 2):
        write_sample_dump(tmp_path / "dumps" / f"{rollout_id}.rld", rollout_id=rollout_id)
    replay = ["--hf-checkpoint", str(tiny_model_dir), "--actor-num-gpus-per-node", "1", "--rollout-batch-size", "3",
              "--n-samples-per-prompt", "2", "--run-dir", str(tmp_path / "run"), "--dry-run"]
    template = str(tmp_path / "dumps" / "{rollout_id}.rld")
    found = run_cli(*replay, "--load-debug-rollout-data", template)
    assert found["status"] == 0 and found["children"] == 0, found["stderr"]
    assert f"--load-debug-rollout-data {template}: 2 dump(s), rollout ids 0..2" in found["stdout"]
    wrong = str(tmp_path / "dump" / "{rollout_id}.rld")
    for count in ([], ["--num-rollout", "2"]):
        missing = run_cli(*replay, "--load-debug-rollout-data", wrong, *count)
        assert missing["status"] == 2 and missing["children"] == 0
        assert missing["stderr"].count(f"--load-debug-rollout-data '{wrong}' matches no dump file") == 1
