"""Soak: the default job (`./run.sh`'s flags, `--num-rollout` unbounded) for N minutes — do throughput, memory
and open files stay flat?

Every `--every-s` seconds it samples: rollouts finished (rows of metrics.jsonl) and rollouts/s over the last
`--window-min` minutes; RSS and open file descriptors of the coordinator, of each engine, of torchrun's ranks;
the number of processes of the run; the CPU seconds they used and the machine's load average (context: on a
shared machine the rate moves with other work, the run's CPU per rollout does not). Minutes count from the
first finished rollout (start-up excluded). The first window after `--warmup-min` is compared with the last;
the target is each figure within 10%. Then it
stops the run with SIGTERM, as a scheduler ends a job, and checks exit status 143 and that no process of the
run is left after 10 s. Prints one line per sample and a summary table; writes `<run_dir>/soak.json`.

Usage: python -m bench.soak --minutes 30 [--nice 10] [--run-dir DIR]   (from the repository root)
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psutil

#: run.sh's default job, minus --num-rollout and --run-dir.
DEFAULT_JOB = ["--prompt-data", "builtin:first_digit", "--rm-type", "first_digit", "--rollout-num-engines", "2",
               "--actor-num-gpus-per-node", "2", "--rollout-batch-size", "32", "--n-samples-per-prompt", "8",
               "--rollout-max-response-len", "4", "--rollout-temperature", "1.0", "--rollout-shuffle", "--lr",
               "3e-3", "--clip-grad", "1.0", "--eps-clip", "0.2", "--sglang-server-concurrency", "128"]
MIB = 1024 * 1024


@dataclass
class Sample:
    minute: float  # since the first finished rollout
    rollouts: int
    rollouts_per_s: float  # over the last window (or since the first rollout, while shorter)
    coordinator_rss_mib: float
    coordinator_fds: int
    coordinator_threads: int
    engine_rss_mib: list[float] = field(default_factory=list)
    engine_fds: list[int] = field(default_factory=list)
    rank_rss_mib: list[float] = field(default_factory=list)
    processes: int = 0
    cpu_s: float = 0.0  # user + system seconds used so far by every process of the run
    load1: float = 0.0  # the machine's 1-minute load average: other work competing for the cores


class MetricsTail:
    """Reads metrics.jsonl as it grows (from where it stopped); keeps the finish times of the last window only."""

    def __init__(self, path: Path, window_s: float) -> None:
        self.path, self.window_s = path, window_s
        self.offset, self.count, self.first = 0, 0, None
        self.times: deque[float] = deque()
        self._partial = b""

    def poll(self) -> None:
        if not self.path.exists():
            return
        with open(self.path, "rb") as handle:
            handle.seek(self.offset)
            data = self._partial + handle.read()
            self.offset = handle.tell()
        *lines, self._partial = data.split(b"\n")
        for line in lines:
            if line.strip():
                finished = float(json.loads(line)["time"])
                self.first = self.first if self.first is not None else finished
                self.count += 1
                self.times.append(finished)
        while self.times and self.times[0] < time.time() - self.window_s:
            self.times.popleft()

    def rate(self) -> float:
        if self.first is None:
            return 0.0
        span = min(self.window_s, time.time() - self.first)
        return len(self.times) / span if span > 0 else 0.0


def kind(process: psutil.Process) -> str:
    """What a process of the run is, by its command line."""
    try:
        line = " ".join(process.cmdline())
    except psutil.Error:
        return "gone"
    if "lifeline.py" in line:
        return "watcher"
    if "-m workers.engine" in line:
        return "engine"
    if "torch.distributed.run" in line:
        return "torchrun"
    if line.endswith("-m workers.train_rank"):
        return "rank"
    return "other"


def rss_mib(process: psutil.Process) -> float:
    try:
        return process.memory_info().rss / MIB
    except psutil.Error:
        return float("nan")


def fds(process: psutil.Process) -> int:
    try:
        return process.num_fds()
    except psutil.Error:
        return -1


def take_sample(coordinator: psutil.Process, tail: MetricsTail, seen: dict[int, psutil.Process]) -> Sample:
    tail.poll()
    children = coordinator.children(recursive=True)
    for child in children:
        seen.setdefault(child.pid, child)
    by_kind: dict[str, list[psutil.Process]] = {}
    for child in children:
        by_kind.setdefault(kind(child), []).append(child)
    minute = (time.time() - tail.first) / 60 if tail.first is not None else 0.0
    return Sample(
        minute=round(minute, 2), rollouts=tail.count, rollouts_per_s=round(tail.rate(), 3),
        coordinator_rss_mib=round(rss_mib(coordinator), 1), coordinator_fds=fds(coordinator),
        coordinator_threads=coordinator.num_threads(),
        engine_rss_mib=[round(rss_mib(p), 1) for p in by_kind.get("engine", [])],
        engine_fds=[fds(p) for p in by_kind.get("engine", [])],
        rank_rss_mib=[round(rss_mib(p), 1) for p in by_kind.get("rank", [])],
        processes=1 + len(children), cpu_s=round(cpu_seconds([coordinator, *children]), 2),
        load1=round(os.getloadavg()[0], 2),
    )


def cpu_seconds(processes: list[psutil.Process]) -> float:
    total = 0.0
    for process in processes:
        try:
            times = process.cpu_times()
        except psutil.Error:
            continue
        total += times.user + times.system
    return total


def show(sample: Sample) -> str:
    return (f"min {sample.minute:6.2f}  rollouts {sample.rollouts:6d}  {sample.rollouts_per_s:6.3f}/s  "
            f"coordinator {sample.coordinator_rss_mib:7.1f} MiB {sample.coordinator_fds:4d} fds "
            f"{sample.coordinator_threads:3d} threads  engines {sample.engine_rss_mib} MiB {sample.engine_fds} fds  "
            f"ranks {sample.rank_rss_mib} MiB  processes {sample.processes}  cpu {sample.cpu_s:.0f} s  "
            f"load {sample.load1:.1f}")


def compare(start: Sample, end: Sample, start_rate: float, end_rate: float) -> list[tuple[str, float, float]]:
    """The figures the issue asks to stay flat, at the start and at the end."""
    return [
        ("rollouts/s", start_rate, end_rate),
        ("coordinator RSS (MiB)", start.coordinator_rss_mib, end.coordinator_rss_mib),
        ("coordinator open fds", start.coordinator_fds, end.coordinator_fds),
        ("engine RSS, sum (MiB)", sum(start.engine_rss_mib), sum(end.engine_rss_mib)),
        ("engine open fds, sum", sum(start.engine_fds), sum(end.engine_fds)),
        ("rank RSS, sum (MiB)", sum(start.rank_rss_mib), sum(end.rank_rss_mib)),
        ("processes of the run", start.processes, end.processes),
    ]


def cpu_per_rollout(samples: list[Sample], minute0: float, minute1: float) -> float:
    """CPU seconds the run spent per finished rollout between two minutes: the run's own cost, which other
    work on the machine does not change (it only changes how long the rollouts wait for a core)."""
    first = min(samples, key=lambda s: abs(s.minute - minute0))
    last = min(samples, key=lambda s: abs(s.minute - minute1))
    done = last.rollouts - first.rollouts
    return (last.cpu_s - first.cpu_s) / done if done > 0 else float("nan")


def mean_load(samples: list[Sample], minute0: float, minute1: float) -> float:
    inside = [s.load1 for s in samples if minute0 <= s.minute <= minute1]
    return sum(inside) / len(inside) if inside else float("nan")


def rate_between(metrics: Path, t0: float, t1: float) -> float:
    """Rollouts/s finished in [t0, t1] (unix time), from metrics.jsonl, read once at the end."""
    finished = 0
    with open(metrics, "rb") as handle:
        for line in handle:
            if line.strip() and t0 <= float(json.loads(line)["time"]) <= t1:
                finished += 1
    return finished / (t1 - t0)


def start_run(args: argparse.Namespace, run_dir: Path) -> subprocess.Popen[bytes]:
    model = run_dir / "tiny-model"
    if not (model / "model.safetensors").exists():
        subprocess.run([sys.executable, "-m", "coordinator.cli", "make-tiny-model", str(model)], check=True,
                       stdout=subprocess.DEVNULL)
    command = [sys.executable, "-m", "coordinator.cli", "train", "--hf-checkpoint", str(model), *DEFAULT_JOB,
               "--num-rollout", "10000000", "--run-dir", str(run_dir / "run"), "--no-progress"]
    if args.nice:
        command = ["nice", "-n", str(args.nice), *command]  # nice execs the command: the pid stays the same
    with open(run_dir / "soak.stderr", "wb") as stderr:
        return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=stderr, start_new_session=True)


def stop_run(proc: subprocess.Popen[bytes], seen: dict[int, psutil.Process]) -> dict[str, object]:
    """SIGTERM, as a scheduler ends a job: the exit status and what is left 10 s after the signal."""
    signalled = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        code = proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        code = proc.wait()
    exited_s = time.monotonic() - signalled
    while time.monotonic() - signalled < 10:
        left = [p for p in seen.values() if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        if not left:
            break
        time.sleep(0.1)
    left = [p for p in seen.values() if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    for process in left:
        process.kill()
    return {"exit_status": code, "exited_after_s": round(exited_s, 2), "left_after_10s": len(left)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=30.0, help="of training, from the first rollout")
    parser.add_argument("--every-s", type=float, default=30.0, help="seconds between samples")
    parser.add_argument("--window-min", type=float, default=5.0, help="minutes each compared window spans")
    parser.add_argument("--warmup-min", type=float, default=2.0, help="minutes before the first window")
    parser.add_argument("--nice", type=int, default=10, help="niceness of the run (0: none)")
    parser.add_argument("--run-dir", type=Path, default=None, help="default: a new temporary directory")
    args = parser.parse_args()
    run_dir = args.run_dir or Path(tempfile.mkdtemp(prefix="rayless-soak-"))
    run_dir.mkdir(parents=True, exist_ok=True)
    proc = start_run(args, run_dir)
    coordinator = psutil.Process(proc.pid)
    tail = MetricsTail(run_dir / "run" / "metrics.jsonl", args.window_min * 60)
    seen: dict[int, psutil.Process] = {}
    samples: list[Sample] = []
    print(f"soak: run dir {run_dir}, {args.minutes:g} minutes of training, a sample every {args.every_s:g} s",
          flush=True)
    try:
        while tail.first is None:  # start-up
            if proc.poll() is not None:
                print(f"the run ended before its first rollout; see {run_dir / 'soak.stderr'}")
                return 1
            tail.poll()
            time.sleep(1.0)
        while (time.time() - tail.first) / 60 < args.minutes:
            if proc.poll() is not None:
                print(f"the run ended with status {proc.returncode}; see {run_dir / 'soak.stderr'}")
                return 1
            samples.append(take_sample(coordinator, tail, seen))
            print(show(samples[-1]), flush=True)
            time.sleep(args.every_s)
        samples.append(take_sample(coordinator, tail, seen))
        print(show(samples[-1]), flush=True)
    finally:
        stopped = stop_run(proc, seen) if proc.poll() is None else {"exit_status": proc.returncode}
    first = tail.first
    warm = first + args.warmup_min * 60
    end = first + args.minutes * 60
    start_sample = min(samples, key=lambda s: abs(s.minute - args.warmup_min))
    start_rate = rate_between(tail.path, warm, warm + args.window_min * 60)
    end_rate = rate_between(tail.path, end - args.window_min * 60, end)
    rows = compare(start_sample, samples[-1], start_rate, end_rate)
    start_window = (args.warmup_min, args.warmup_min + args.window_min)
    end_window = (args.minutes - args.window_min, args.minutes)
    context = [("CPU s per rollout (the run's)", cpu_per_rollout(samples, *start_window),
                cpu_per_rollout(samples, *end_window)),
               ("machine load average", mean_load(samples, *start_window), mean_load(samples, *end_window))]
    print(f"\nstart: minute {start_sample.minute:g} (rate over minutes {args.warmup_min:g}–"
          f"{args.warmup_min + args.window_min:g}); end: minute {samples[-1].minute:g} (rate over the last "
          f"{args.window_min:g} minutes)")
    print(f"{'figure':28s} {'start':>10s} {'end':>10s} {'change':>8s}")
    flat = True
    for name, before, after in rows:
        change = (after - before) / before * 100 if before else float("nan")
        flat &= abs(change) <= 10
        print(f"{name:28s} {before:10.3f} {after:10.3f} {change:+7.1f}%")
    for name, before, after in context:  # why the rate moved, if it did: the run's cost, or the machine's load
        change = (after - before) / before * 100 if before else float("nan")
        print(f"{name:28s} {before:10.3f} {after:10.3f} {change:+7.1f}%  (context)")
    print(f"stopped with SIGTERM: {stopped}")
    print("flat within 10%" if flat else "NOT flat within 10%")
    (run_dir / "soak.json").write_text(json.dumps({
        "samples": [asdict(sample) for sample in samples], "compare": rows, "context": context, "stop": stopped,
        "flat": flat,
        "args": {key: str(value) for key, value in vars(args).items()},
    }, indent=1))
    return 0 if flat and stopped.get("exit_status") == 143 and stopped.get("left_after_10s") == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
