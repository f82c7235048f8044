"""Known failures, provoked for real in `rayless train` subprocesses, each reported as one line (what failed,
where, what to do) with exit status 1 and no traceback on the terminal.

The user's own code raising (a reward function, a rollout function) is named by file and line, its traceback
kept in the run's coordinator.log; a rank command failing for the environment's sake (an unwritable save
directory) keeps its traceback in train_ranks.log; a rank killed mid-run is explained by torchrun's own
report of which rank died of what, not by torchrun's traceback; an attached router that is not there and a
taken control port are named with the flag to change; an agent that hangs, makes no model call or raises ends
the run once its failure budget is spent, named with the count. (An engine that fails to start: test_startup_progress;
bad flags and data files, exit 2: test_config_cli.)
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from coordinator.lifecycle.processes import terminate_process_group_blocking
from tests.support.engine_proc import start_engine_process
from tests.support.replay_inputs import write_sample_dump
from tests.support.waiting import wait_until_sync

FAILING_HOOKS = '''
def reward(sample):
    return _score(sample)


def _score(sample):
    raise ValueError("the grader cannot parse this answer")


class Rollout:
    def __init__(self, context):
        self.context = context

    async def __call__(self, rollout_id, weight_version):
        raise KeyError("expected_field")
'''


def train_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "coordinator.cli", "train", *args, "--no-progress"]


def train(*args: str, pythonpath: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    if pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(pythonpath), env.get("PYTHONPATH", "")])
    return subprocess.run(train_command(*args), capture_output=True, text=True, timeout=300, check=False, env=env)


def failure_line(result: subprocess.CompletedProcess[str]) -> str:
    """The one `run failed:` line of a run that exited 1 with no traceback on the terminal."""
    assert result.returncode == 1, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if "run failed:" in line]
    assert len(lines) == 1, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    return lines[0]


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> Iterator[str]:
    """One CPU engine (host:port) that every rollout-only run here attaches to: what fails is the user's code
    or the router, never the engine, so each run need not launch its own."""
    with start_engine_process(tiny_model_dir) as running:
        yield running.url.removeprefix("http://")


def rollout_only(model: Path, engine: str, run_dir: Path, *flags: str) -> list[str]:
    return ["--hf-checkpoint", str(model), "--prompt-data", "builtin:first_digit",
            "--rollout-external-engine-addrs", engine, "--debug-rollout-only", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--num-rollout", "1",
            "--rollout-max-response-len", "4", "--run-dir", str(run_dir), *flags]


def replay(model: Path, tmp_path: Path, rollouts: int, *flags: str) -> list[str]:
    """Replay of `rollouts` small dumps on one rank: no engine is started."""
    for rollout_id in range(rollouts):
        write_sample_dump(tmp_path / "dumps" / f"{rollout_id}.rld", rollout_id=rollout_id)
    return ["--hf-checkpoint", str(model), "--actor-num-gpus-per-node", "1", "--rollout-batch-size", "3",
            "--n-samples-per-prompt", "2", "--load-debug-rollout-data", str(tmp_path / "dumps" / "{rollout_id}.rld"),
            "--num-rollout", str(rollouts), "--run-dir", str(tmp_path / "run"), *flags]


def test_a_reward_function_that_raises_is_named_by_its_file_and_line(tiny_model_dir: Path, engine: str,
                                                                     tmp_path: Path) -> None:
    (tmp_path / "my_hooks.py").write_text(FAILING_HOOKS)
    result = train(*rollout_only(tiny_model_dir, engine, tmp_path / "run", "--custom-rm-path", "my_hooks:reward"),
                   pythonpath=tmp_path)
    line = failure_line(result)
    assert "ValueError: the grader cannot parse this answer" in line
    assert f"raised by your code at {tmp_path / 'my_hooks.py'}:7 (in _score)" in line
    log = (tmp_path / "run" / "coordinator.log").read_text()
    assert "Traceback" in log and 'raise ValueError("the grader cannot parse this answer")' in log


def test_a_rollout_function_that_raises_is_named_by_its_file_and_line(tiny_model_dir: Path, engine: str,
                                                                      tmp_path: Path) -> None:
    (tmp_path / "my_hooks.py").write_text(FAILING_HOOKS)
    result = train(*rollout_only(tiny_model_dir, engine, tmp_path / "run", "--rm-type", "first_digit",
                                 "--rollout-function-path", "my_hooks:Rollout"), pythonpath=tmp_path)
    line = failure_line(result)
    assert "KeyError: 'expected_field'" in line and f"{tmp_path / 'my_hooks.py'}:15 (in __call__)" in line


#: an agent whose first episode makes no model call, whose second raises, and whose every later one hangs
FAILING_AGENT = '''
import asyncio

CALLS = [0]


async def agent(*, base_url, prompt, request_kwargs, metadata, **kwargs):
    CALLS[0] += 1
    if CALLS[0] == 1:
        return {}
    if CALLS[0] == 2:
        raise RuntimeError("the environment went away")
    await asyncio.Event().wait()
'''


def test_an_agent_that_hangs_never_calls_the_model_or_raises_ends_the_run_naming_it(
        tiny_model_dir: Path, engine: str, tmp_path: Path) -> None:
    """Once the failure budget is spent the run ends by itself (it used to retry such an agent for ever), with
    one line naming the agent and the count; each failure kind is in the log."""
    (tmp_path / "my_agent.py").write_text(FAILING_AGENT)
    result = train(*rollout_only(tiny_model_dir, engine, tmp_path / "run",
                                 "--custom-generate-function-path", "miles.rollout.generate_hub.agentic_tool_call.generate",
                                 "--custom-agent-function-path", "my_agent:agent", "--use-session-server",
                                 "--rm-type", "first_digit", "--agent-timeout-s", "1",
                                 "--hook-max-failures-in-a-row", "4"), pythonpath=tmp_path)
    line = failure_line(result)
    assert "--custom-agent-function-path 'my_agent:agent' failed 4 times in a row (--hook-max-failures-in-a-row); " \
        "last: --custom-agent-function-path 'my_agent:agent' did not return within 1 s (--agent-timeout-s)" in line
    log = (tmp_path / "run" / "coordinator.log").read_text()
    assert "'my_agent:agent' did not return within 1 s (--agent-timeout-s)" in log
    assert "recorded no usable model call" in log and "RuntimeError: the environment went away" in log


def test_an_attached_router_that_is_not_there(tiny_model_dir: Path, engine: str, tmp_path: Path) -> None:
    result = train(*rollout_only(tiny_model_dir, engine, tmp_path / "run", "--rm-type", "first_digit",
                                 "--use-sglang-router", "--sglang-router-ip", "127.0.0.1", "--sglang-router-port", "9"))
    line = failure_line(result)
    assert "RouterError: no sglang-router answers at 127.0.0.1:9 (--sglang-router-ip/--sglang-router-port)" in line


def test_a_rank_command_failing_for_the_environment_keeps_its_traceback_in_the_ranks_log(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    save = tmp_path / "ckpt"
    save.mkdir()
    blocked = save / "tmp-0"  # where the save of rollout 0 writes first: a file, so it cannot be a directory
    blocked.write_text("not a directory")
    result = train(*replay(tiny_model_dir, tmp_path, 1, "--save", str(save)))
    line = failure_line(result)
    assert "RankCommandError: command 'save' failed on rank(s) 0: FileExistsError" in line and str(blocked) in line
    assert "(the rank's traceback is in its log, train_ranks.log)" in line
    assert "Traceback" in (tmp_path / "run" / "train_ranks.log").read_text()


def test_a_taken_control_port_names_the_flag(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Found by the start-up checks (exit 2, the flag named), before the run directory or any process exists;
    tests/unit/test_startup_checks.py checks the same in-process, no child process started."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = train(*replay(tiny_model_dir, tmp_path, 1, "--control-port", str(port)))
    assert result.returncode == 2, result.stderr[-3000:]
    assert f"rayless train: error: --control-port {port}: 127.0.0.1:{port} is in use" in result.stderr
    assert "give another port (0: any free port)" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "run").exists()  # refused before the run directory, torchrun or any engine


def test_a_rank_killed_mid_run_is_explained_by_torchruns_report(tiny_model_dir: Path, tmp_path: Path) -> None:
    stderr = tmp_path / "stderr"
    metrics = tmp_path / "run" / "metrics.jsonl"
    with open(stderr, "w") as err:
        proc = subprocess.Popen(train_command(*replay(tiny_model_dir, tmp_path, 400)), stderr=err, text=True,
                                start_new_session=True)
    try:
        def trained() -> bool:
            if metrics.exists() and metrics.stat().st_size > 0:
                return True
            assert proc.poll() is None, stderr.read_text()[-3000:]
            return False

        wait_until_sync(trained, timeout=240, interval=0.1, what=f"a first row in {metrics}")
        ranks = [p for p in psutil.Process(proc.pid).children(recursive=True)
                 if p.cmdline()[-2:] == ["-m", "workers.train_rank"] and "torch.distributed.run" not in p.cmdline()
                 and "lifeline" not in " ".join(p.cmdline())]
        assert len(ranks) == 1, [p.cmdline() for p in ranks]
        ranks[0].kill()
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            terminate_process_group_blocking(proc, grace=1.0)
    result = subprocess.CompletedProcess(proc.args, proc.returncode, "", stderr.read_text())
    line = failure_line(result)
    assert "RankFailure: training rank(s) 0 failed: " in line
    report = result.stderr[result.stderr.index(line):]
    assert "workers.train_rank FAILED" in report and "(SIGKILL)" in report
