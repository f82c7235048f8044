"""The torchrun child process that runs the training ranks: its command line, environment, exit and log.

Owns the `torchrun` process (leader of its own process group, so its ranks are in that group too) and its
log file in the run directory. Started, watched and ended with `coordinator.lifecycle.processes`, like engines and the
router.

Invariants:
- The control token and address reach the ranks in their environment, never on the command line, and
  `extra_env` cannot replace them.
- `stop()` ends the whole group on every path: the ranks get `grace_s` to exit after their shutdown command,
  then SIGTERM, SIGKILL after another `grace_s`, sweep and reap; the log file is closed.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import anyio

from coordinator.lifecycle.processes import (
    exit_status,
    read_tail,
    spawn_group_leader,
    terminate_process_group,
    wait_exited,
)
from coordinator.train.errors import RankFailure
from workers import protocol


@dataclass(frozen=True)
class TorchrunSpec:
    """How to run the ranks: `python -m torch.distributed.run ... -m workers.train_rank`."""

    nproc_per_node: int
    nnodes: int = 1
    node_rank: int | None = None
    rdzv_backend: str | None = None
    rdzv_endpoint: str | None = None
    #: `--rdzv-conf` key=value pairs (multi-node: which torchrun hosts the rendezvous store, `is_host`)
    rdzv_conf: tuple[tuple[str, str], ...] = ()
    max_restarts: int = 0
    python: str = field(default=sys.executable)

    def __post_init__(self) -> None:
        if self.nproc_per_node < 1 or self.nnodes < 1:
            raise ValueError(
                f"nproc_per_node ({self.nproc_per_node}) and nnodes ({self.nnodes}) must be >= 1"
            )
        if self.nnodes > 1 and not self.rdzv_endpoint:
            raise ValueError("a multi-node TrainGroup (nnodes > 1) needs rdzv_endpoint (host:port)")

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes

    def command(self, log_dir: Path | None = None) -> list[str]:
        """The command line; `log_dir`: torchrun's `--log-dir` (its per-attempt directories and the ranks' error
        files), which it otherwise makes under /tmp and never removes — one `torchelastic_*` a launch."""
        command = [self.python, "-m", "torch.distributed.run", "--nproc-per-node", str(self.nproc_per_node)]
        if log_dir is not None:
            command += ["--log-dir", str(log_dir)]
        if self.nnodes > 1 or self.rdzv_endpoint:
            command += ["--nnodes", str(self.nnodes)]
            if self.node_rank is not None:
                command += ["--node-rank", str(self.node_rank)]
            command += [
                "--rdzv-backend",
                self.rdzv_backend or "c10d",
                "--rdzv-endpoint",
                str(self.rdzv_endpoint),
            ]
            if self.rdzv_conf:
                command += ["--rdzv-conf", ",".join(f"{key}={value}" for key, value in self.rdzv_conf)]
        else:
            # A private rendezvous on a free port: several groups (tests, evals) can run side by side.
            command += ["--standalone"]
        command += ["--max-restarts", str(self.max_restarts), "-m", "workers.train_rank"]
        return command


def torchrun_log_dir(log_path: Path) -> Path:
    """torchrun's `--log-dir` beside its log file (the run directory's `torchrun/`)."""
    return log_path.parent / "torchrun"


#: The rule torchrun draws around its failure report (`ChildFailedError`), above and below.
_RULE = "=" * 20


def torchrun_summary(log_tail: str, max_lines: int = 40) -> str:
    """torchrun's own report of failed ranks (which rank, exit code or signal, the rank's traceback) from the
    end of its log, without the traceback of torchrun itself that precedes it; "" when the log has none."""
    lines = log_tail.splitlines()
    ends = [index for index, line in enumerate(lines) if line.startswith(_RULE)]
    for end in reversed(ends):  # the last report: a rule, a title ending in FAILED, ..., a rule
        starts = [index for index in ends if index < end and lines[index + 1].rstrip().endswith("FAILED")]
        if starts:
            return "\n".join(lines[starts[-1]:end + 1][-max_lines:])
    return ""


class TorchrunProcess:
    """One launch of torchrun. `start()` → running; `stop()` ends its process group; `explain()` adds its log."""

    def __init__(
        self,
        spec: TorchrunSpec,
        *,
        log_path: Path,
        grace_s: float = 5.0,
        torch_threads: int = 1,
        extra_env: dict[str, str] | None = None,
    ) -> None:
        self.spec = spec
        self.log_path = log_path
        self.grace_s = grace_s
        self.torch_threads = torch_threads
        self.extra_env = dict(extra_env or {})
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def child_environment(self, control_env: dict[str, str]) -> dict[str, str]:
        """The ranks' environment: ours, the control channel's, then `extra_env` (which may tune threads or
        the frame limit but never replace the address or the token)."""
        env = {**os.environ, **control_env, **self.extra_env}
        env.update({key: control_env[key] for key in (protocol.ENV_ADDR, protocol.ENV_TOKEN)})
        env.setdefault("OMP_NUM_THREADS", str(self.torch_threads))
        return env

    async def start(self, control_env: dict[str, str]) -> None:
        # The child writes to this file directly; stop() closes it.
        self._log = await anyio.to_thread.run_sync(open, self.log_path, "ab")
        command = self.spec.command(log_dir=torchrun_log_dir(self.log_path))
        self._log.write(f"$ {' '.join(command)}\n".encode())
        self._log.flush()
        self.proc = spawn_group_leader(command, log=self._log, env=self.child_environment(control_env))

    async def wait_exited(self) -> int:
        """torchrun's exit status, once it has exited (not reaped: `stop()` reaps)."""
        assert self.proc is not None, "wait_exited() before start()"
        return await wait_exited(self.proc)

    async def explain(self, failure: RankFailure) -> RankFailure:
        """The failure with the log's last lines; torchrun gets a moment to write the rank's traceback."""
        if failure.log_tail:
            return failure
        if self.proc is not None and exit_status(self.proc) is None:
            with anyio.move_on_after(min(self.grace_s, 3.0)):
                await wait_exited(self.proc)
        tail = torchrun_summary(read_tail(self.log_path, lines=400)) or read_tail(self.log_path)
        return RankFailure(failure.ranks, failure.reason, log_path=self.log_path, log_tail=tail)

    async def stop(self) -> None:
        """Let torchrun exit by itself for `grace_s` (its ranks were asked to shut down), then end its whole
        process group and close the log. Shielded; safe to call again."""
        with anyio.CancelScope(shield=True):
            proc = self.proc
            if proc is not None and proc.returncode is None:
                with anyio.move_on_after(self.grace_s):
                    await wait_exited(proc)
                await terminate_process_group(proc, self.grace_s)
            if self._log is not None:
                self._log.close()
                self._log = None
