"""Multi-node runs on one machine: `rayless train` processes given SLURM-style variables, and what they leave.

`NodeProcess` starts one node's `rayless train` (node rank from `SLURM_NODEID`, node 0 from
`SLURM_JOB_NODELIST=localhost`, the rendezvous port from `MASTER_PORT`, the token from `RAYLESS_CONTROL_TOKEN`),
records every process it starts below it (the torchrun agent, the ranks, the engines) each time it is looked
at, and can end the whole tree at once with SIGKILL: what a node's power failure does to the run.

`gated_reward` (a `--custom-rm-path`): sample_index % 2, so every prompt group has a spread and every step a
gradient; with RAYLESS_TEST_GATE=DIR it writes DIR/reached when the second rollout's first sample is scored,
then waits for DIR/go, so a test can act at a known point of a run in another process.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import psutil

from tests.support.waiting import wait_until, wait_until_sync

GATE_ENV = "RAYLESS_TEST_GATE"
SAMPLES_PER_ROLLOUT = 4  # --rollout-batch-size 2 × --n-samples-per-prompt 2
#: How often the waits below look at a node's tree: psutil finds children by reading every process on the
#: machine (~10 ms on a shared one), so looking at each 0.2 s poll cost more CPU than the node processes' idling;
#: the run's processes live for seconds, and kill_tree() always looks first.
LOOK_EVERY_S = 1.0
_scored = 0


async def gated_reward(sample: Any) -> float:
    global _scored
    _scored += 1
    gate = os.environ.get(GATE_ENV)
    if gate and _scored == SAMPLES_PER_ROLLOUT + 1:
        await anyio.Path(gate, "reached").write_text("")
        await wait_until(anyio.Path(gate, "go").exists, timeout=300, interval=0.1,
                         what="the test's go file (another process writes it)")
    return float(sample.sample_index % 2)


class NodeProcess:
    """One node's `rayless train` and everything it starts; `seen` keeps every pid ever found below it."""

    def __init__(self, node_rank: int, args: list[str], *, master_port: int, token: str, log: Path,
                 env: dict[str, str] | None = None) -> None:
        environment = {
            **os.environ, "SLURM_NODEID": str(node_rank), "SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "localhost",
            "MASTER_PORT": str(master_port), "RAYLESS_CONTROL_TOKEN": token, **(env or {}),
        }
        self.node_rank = node_rank
        self.log = log
        self._out = open(log, "ab")  # closed in wait() / kill_tree()
        self.proc = subprocess.Popen([sys.executable, "-m", "coordinator.cli", "train", *args], env=environment,
                                     stdout=self._out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        #: every process ever found below the node process (psutil remembers each one's start time, so a pid
        #: reused later by an unrelated process is not taken for it)
        self.seen: dict[int, tuple[psutil.Process, str]] = {self.proc.pid: (psutil.Process(self.proc.pid),
                                                                             "rayless train")}
        self.looked_at = -float("inf")

    def look(self, *, tree: dict[int, list[int]] | None = None) -> None:
        """Record the processes below the node process now; `tree`: a `children_by_parent()` to walk."""
        self.looked_at = time.monotonic()
        tree = children_by_parent() if tree is None else tree
        pending = list(tree.get(self.proc.pid, ()))
        while pending:
            pid = pending.pop()
            pending += tree.get(pid, ())
            if pid in self.seen:
                continue
            try:
                child = psutil.Process(pid)
                self.seen[pid] = (child, " ".join(child.cmdline())[:200])
            except psutil.Error:
                continue

    def wait(self, timeout: float, *, others: tuple[NodeProcess, ...] = ()) -> int:
        """The node process's exit status, looking at its tree (and `others`') every `LOOK_EVERY_S` meanwhile."""
        def exit_status() -> int | None:
            look_at((self, *others), at_most_every=LOOK_EVERY_S)
            return self.proc.poll()

        try:
            wait_until_sync(exit_status, until=lambda code: code is not None, timeout=timeout, interval=0.5,
                            what=f"node {self.node_rank} to exit")
        except AssertionError as error:
            self.kill_tree()
            raise AssertionError(f"{error}; its output:\n{self.output()[-4000:]}") from None
        self._out.close()
        return self.proc.returncode

    def kill_tree(self) -> None:
        """SIGKILL the node process and every process below it at once (a node that lost power)."""
        self.look()
        victims = [process for process, _ in self.seen.values() if process.is_running()]
        for victim in victims:
            try:
                victim.send_signal(signal.SIGKILL)  # psutil checks it is still the process it saw
            except psutil.NoSuchProcess:
                continue
        psutil.wait_procs(victims, timeout=10)
        self.proc.wait(timeout=10)
        self._out.close()

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def survivors(self) -> list[str]:
        """Every process ever seen below this node that still runs (zombies excluded)."""
        alive = []
        for pid, (process, command) in self.seen.items():
            try:
                if process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
                    alive.append(f"pid {pid}: {command}")
            except psutil.NoSuchProcess:
                continue
        return alive


def children_by_parent() -> dict[int, list[int]]:
    """Every process's pid under its parent's: one pass over the machine's processes, however many trees."""
    tree: dict[int, list[int]] = {}
    for process in psutil.process_iter(["ppid"]):
        tree.setdefault(process.info["ppid"], []).append(process.pid)
    return tree


def look_at(nodes: tuple[NodeProcess, ...], *, at_most_every: float = 0.0) -> None:
    """`look()` at the nodes not looked at in the last `at_most_every` s, from one pass over the processes."""
    due = [node for node in nodes if time.monotonic() - node.looked_at >= at_most_every]
    if due:
        tree = children_by_parent()
        for node in due:
            node.look(tree=tree)


def wait_for(path: Path, timeout: float, *, nodes: tuple[NodeProcess, ...] = ()) -> None:
    """Wait for `path` to exist (failing early, with its output, when a node process exits meanwhile)."""
    def appeared() -> bool:
        if path.exists():
            return True
        look_at(nodes, at_most_every=LOOK_EVERY_S)
        for node in nodes:
            if node.proc.poll() is not None:
                raise AssertionError(f"node {node.node_rank} exited ({node.proc.returncode}) while waiting for "
                                     f"{path.name}; its output:\n{node.output()[-4000:]}")
        return False

    wait_until_sync(appeared, timeout=timeout, interval=0.2, what=f"{path} to appear")
