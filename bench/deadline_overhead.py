"""The cost of the loop watchdog and the deadlines on the default job's rollouts/s, against the same job without
them: whole short runs, alternated.

Each run is `rayless train` with `./run.sh`'s default job (bench/soak.py's `DEFAULT_JOB`: 2 CPU engines, 2
ranks) for `--rollouts` rollouts. "on" is the code as it ships. "off" is the same command started through this
module with the watchdog and the deadlines switched off in the process (this bench only; the product has no such
switch): the loop watchdog's task and thread (`LoopWatchdog.run`), the rank-command watch and its deadline
(`RankCallWatch.run`), the engine client's head watch and generation bound (`EngineClient.watch_stalls`) and the
per-request stall clock (`ReplyClock`, replaced by one that does nothing). The weight-load acknowledgment's
deadline is one cancel scope per engine per update and stays in both.

Runs alternate on/off, the order of each pair swapped every other pair, so a change in the machine's load falls
on both alike. A run's rollouts/s is its rollouts after the first (warm-up) over the sum of their `step/time_s`
(the loop's own time per rollout in metrics.jsonl: start-up is not counted). Prints every run, the median of each
condition and their ratio (goal: on ≥ 0.98 × off; exit 1 when missed), the median of the pairs' ratios, and the
coordinator process's own CPU seconds per run (its share whatever else the machine runs). Usage:
python -m bench.deadline_overhead [--pairs 3] [--rollouts 6] [--model DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.soak import DEFAULT_JOB

TARGET = 0.98


def switch_off() -> None:
    """In this process: the watchdog and the deadlines do nothing (the "off" condition)."""
    import anyio

    from coordinator.engines import client
    from coordinator.observe import rank_watch, watchdog

    async def idle(self: Any, *, task_status: Any = anyio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        await anyio.sleep_forever()

    class NoClock:
        def __init__(self, **_: Any) -> None:
            pass

        def headed(self) -> None:
            pass

        def advance(self, size: int) -> None:
            pass

        def __enter__(self) -> NoClock:
            return self

        def __exit__(self, *exc_info: object) -> bool:
            return False

    watchdog.LoopWatchdog.run = idle  # type: ignore[method-assign]
    rank_watch.RankCallWatch.run = idle  # type: ignore[method-assign]
    client.EngineClient.watch_stalls = idle  # type: ignore[method-assign]
    client.ReplyClock = NoClock  # type: ignore[misc, assignment]


def child(condition: str, argv: list[str]) -> None:
    if condition == "off":
        switch_off()
    from coordinator.cli import run_and_exit

    sys.argv = ["rayless", *argv]
    run_and_exit()


def one_run(condition: str, model: Path, rollouts: int, run_dir: Path) -> dict[str, Any]:
    """One run; its rollouts/s and the coordinator process's own CPU seconds (sampled until it exits: the
    engines' and ranks' are their processes', not counted)."""
    import psutil

    command = [sys.executable, "-m", "bench.deadline_overhead", "--child", condition, "--", "train",
               "--hf-checkpoint", str(model), *DEFAULT_JOB, "--num-rollout", str(rollouts), "--run-dir",
               str(run_dir), "--no-progress"]
    run_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    cpu = 0.0
    with open(run_dir.parent / f"{run_dir.name}.stderr", "w+b") as stderr:
        proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=stderr)
        coordinator = psutil.Process(proc.pid)
        while proc.poll() is None:
            try:
                times = coordinator.cpu_times()
                cpu = times.user + times.system
            except psutil.Error:
                pass
            time.sleep(0.25)
        wall = time.monotonic() - started
        if proc.returncode != 0:
            stderr.seek(0)
            raise SystemExit(f"{condition} run failed ({proc.returncode}):\n{stderr.read()[-3000:].decode()}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    seconds = [row["step/time_s"] for row in rows[1:]]
    return {"condition": condition, "rollouts_per_s": len(seconds) / sum(seconds), "wall_s": wall,
            "rollouts": len(rows), "coordinator_cpu_s": cpu}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--rollouts", type=int, default=6)
    parser.add_argument("--model", type=Path, default=None, help="a tiny model directory (built when not given)")
    parser.add_argument("--child", choices=("on", "off"), default=None, help=argparse.SUPPRESS)
    args, rest = parser.parse_known_args()
    if args.child is not None:
        child(args.child, rest[1:] if rest[:1] == ["--"] else rest)
        return
    with tempfile.TemporaryDirectory(prefix="rayless-deadline-bench-") as tmp:
        root = Path(tmp)
        model = args.model
        if model is None:
            model = root / "tiny"
            subprocess.run([sys.executable, "-m", "coordinator.cli", "make-tiny-model", str(model)], check=True,
                           capture_output=True)
        runs: list[dict[str, Any]] = []
        for pair in range(args.pairs):
            order = ("on", "off") if pair % 2 == 0 else ("off", "on")
            for condition in order:
                run = one_run(condition, model, args.rollouts, root / f"run-{pair}-{condition}")
                runs.append(run)
                print(f"pair {pair} {condition:3}: {run['rollouts_per_s']:.3f} rollouts/s "
                      f"({run['rollouts']} rollouts, {run['wall_s']:.0f} s wall, coordinator CPU "
                      f"{run['coordinator_cpu_s']:.1f} s)", flush=True)
    on = [run["rollouts_per_s"] for run in runs if run["condition"] == "on"]
    off = [run["rollouts_per_s"] for run in runs if run["condition"] == "off"]
    pairs = [a / b for a, b in zip(on, off, strict=True)]
    ratio = statistics.median(on) / statistics.median(off)
    print(f"median rollouts/s: on {statistics.median(on):.3f}, off {statistics.median(off):.3f}; ratio {ratio:.3f} "
          f"(goal >= {TARGET}); median of the pairs' ratios {statistics.median(pairs):.3f} "
          f"(each: {', '.join(f'{r:.3f}' for r in pairs)}): {'MET' if ratio >= TARGET else 'NOT MET'}")
    cpu_on = statistics.median(run["coordinator_cpu_s"] for run in runs if run["condition"] == "on")
    cpu_off = statistics.median(run["coordinator_cpu_s"] for run in runs if run["condition"] == "off")
    print(f"coordinator CPU per run (median, start-up included): on {cpu_on:.1f} s, off {cpu_off:.1f} s "
          f"({(cpu_on - cpu_off) / args.rollouts * 1000:+.0f} ms per rollout)")
    if ratio < TARGET:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
