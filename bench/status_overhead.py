"""The status server's cost to the loop: the default job's rollouts/s with the status page polled 10 times a
second against without it, in one run.

Runs `rayless train` with `./run.sh`'s default job (bench/soak.py's `DEFAULT_JOB`) and `--status-port`, and,
from this process (as a browser would be: another process), alternates blocks of `--block` rollouts with
`/status` fetched every 0.1 s (fixed rate, as the page at `?poll=100`) and blocks with nothing fetched.
Interleaving the two conditions in one run keeps the machine's load and the model's state the same for both;
the first block is dropped (warm-up). Each rollout's seconds are the loop's own `step/time_s` in metrics.jsonl.
Prints rollouts/s of each condition, their ratio (goal: polled within 3% of not polled), the coordinator's
median CPU milliseconds per rollout in each (the server's own cost, whatever else the machine runs), the
number of `/status` answers and their median latency. Usage:
python -m bench.status_overhead [--rollouts 25] [--block 4] [--model DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import psutil

from bench.soak import DEFAULT_JOB

POLL_S = 0.1
#: polled rollouts/s over not polled (the issue's goal: within 3%)
TARGET = 0.97


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Poller:
    """Fetches /status every POLL_S seconds while `on` is set; keeps each answer's latency."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.on = threading.Event()
        self.stop = threading.Event()
        self.latencies: list[float] = []
        self.failures = 0

    def run(self) -> None:
        with httpx.Client(timeout=5) as client:
            due = time.monotonic()
            while not self.stop.is_set():
                if not self.on.wait(0.05):
                    due = time.monotonic()
                    continue
                started = time.monotonic()
                try:
                    client.get(f"{self.url}/status").raise_for_status()
                    self.latencies.append(time.monotonic() - started)
                except httpx.HTTPError:
                    self.failures += 1
                due += POLL_S
                self.stop.wait(max(0.0, due - time.monotonic()))


def rows(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rollouts", type=int, default=25)
    parser.add_argument("--block", type=int, default=4)
    parser.add_argument("--model", type=Path, default=None, help="a model directory (default: a new tiny model)")
    options = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="status-overhead-"))
    model = options.model
    if model is None:
        from workers.tiny_model import build_tiny_model

        model = build_tiny_model(work / "model")
    port = free_port()
    run_dir = work / "run"
    command = [sys.executable, "-m", "coordinator.cli", "train", "--hf-checkpoint", str(model), *DEFAULT_JOB,
               "--num-rollout", str(options.rollouts), "--run-dir", str(run_dir), "--no-progress",
               "--status-port", str(port)]
    poller = Poller(f"http://127.0.0.1:{port}")
    thread = threading.Thread(target=poller.run, daemon=True)
    thread.start()
    condition: dict[int, bool] = {}  # rollout id -> polled while it ran
    cpu_at: dict[int, float] = {}  # rollout id -> the coordinator's CPU seconds when it began
    with open(work / "train.log", "wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=os.environ.copy())
        coordinator = psutil.Process(process.pid)
        try:
            while process.poll() is None:
                done = len(rows(run_dir / "metrics.jsonl"))
                polled = (done // options.block) % 2 == 1
                (poller.on.set if polled else poller.on.clear)()
                if done not in condition:
                    condition[done] = polled
                    with contextlib.suppress(psutil.Error):
                        times = coordinator.cpu_times()
                        cpu_at[done] = times.user + times.system
                time.sleep(0.02)  # a bench's sampling cadence, not a wait for a condition
        finally:
            poller.stop.set()
            if process.poll() is None:
                process.terminate()
                process.wait(30)
    if process.returncode != 0:
        print(f"rayless train failed ({process.returncode}); see {work / 'train.log'}", file=sys.stderr)
        return 1
    seconds: dict[bool, list[float]] = {True: [], False: []}
    for row in rows(run_dir / "metrics.jsonl"):
        step = row["step"]
        if step >= options.block and step in condition:  # the first block warms up
            seconds[condition[step]].append(row["step/time_s"])
    rate = {polled: len(s) / sum(s) for polled, s in seconds.items() if s}
    cpu: dict[bool, list[float]] = {True: [], False: []}  # the coordinator's CPU seconds per rollout
    for step, polled in condition.items():
        if step >= options.block and step in cpu_at and step + 1 in cpu_at:
            cpu[polled].append(cpu_at[step + 1] - cpu_at[step])
    cpu_ms = {polled: statistics.median(v) * 1e3 for polled, v in cpu.items() if v}
    result = {
        "rollouts": {("polled" if k else "not_polled"): len(v) for k, v in seconds.items()},
        "rollouts_per_s_not_polled": rate.get(False), "rollouts_per_s_polled": rate.get(True),
        "polled_over_not_polled": rate[True] / rate[False] if True in rate and False in rate else None,
        "coordinator_cpu_ms_per_rollout_not_polled": cpu_ms.get(False),
        "coordinator_cpu_ms_per_rollout_polled": cpu_ms.get(True),
        "status_answers": len(poller.latencies), "status_failures": poller.failures,
        "status_latency_median_ms": statistics.median(poller.latencies) * 1e3 if poller.latencies else None,
        "cpu_count": os.cpu_count(), "load_1min": os.getloadavg()[0],
    }
    ratio = result["polled_over_not_polled"]
    result["target_met"] = ratio is not None and ratio >= TARGET
    print(json.dumps(result, indent=2))
    return 0 if result["target_met"] else 1


if __name__ == "__main__":
    sys.exit(main())
