"""Seconds from launching `rayless train --load-debug-rollout-data ...` to the first finished train step.

Split into the ranks' part (torchrun start, torch import, process group, model load: from the moment the
coordinator launches torchrun until every rank has answered `init`), the first train step itself, and the
coordinator's own part (everything else: interpreter start, imports, config, the replay loader, the control
channel). For scale, on these machines `ray.init()` plus one actor alone took 3.9–6.1 s before any work
(docs/benchmarks.md). Target: the coordinator's own part ≤ 1 s.
Usage: python -m bench.startup [--repeats 3] [--ranks 1]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def write_dumps(directory: Path) -> str:
    from replay.format import dump_path, write_dump
    from replay.sample import Sample, SampleStatus

    template = str(directory / "{rollout_id}.rld")
    rng = random.Random(0)
    samples = [
        Sample(group_index=g, sample_index=k, prompt="3 1 4=", tokens=[8, 4, 3, 4, 6, 18] + [rng.randrange(5, 80)
               for _ in range(4)], response_length=4, loss_mask=[1] * 4, rollout_log_probs=[-4.4] * 4,
               reward=float(rng.random() < 0.5), status=SampleStatus.COMPLETED, weight_versions=["0"])
        for g in range(8) for k in range(8)
    ]
    write_dump(dump_path(template, 0), 0, samples, config_facts={})
    return template


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ranks", type=int, default=1)
    options = parser.parse_args()
    from workers.tiny_model import build_tiny_model

    work = Path(tempfile.mkdtemp())
    model = build_tiny_model(work / "tiny")
    template = write_dumps(work / "dumps")
    rayless = str(Path(sys.executable).parent / "rayless")
    print(f"{'run':>3} {'to first step':>14} {'ranks (torchrun+import+load)':>29} {'step':>6} {'coordinator':>12}")
    own = []
    for repeat in range(options.repeats):
        run_dir = work / f"run{repeat}"
        command = [rayless, "train", "--hf-checkpoint", str(model), "--load-debug-rollout-data", template,
                   "--num-rollout", "1", "--actor-num-gpus-per-node", str(options.ranks), "--run-dir", str(run_dir),
                   "--no-progress"]
        launched = time.time()
        subprocess.run(command, check=True, capture_output=True, env={**os.environ, "MPLBACKEND": "Agg"})
        summary = json.loads((run_dir / "summary.json").read_text())
        first = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])
        to_first_step = first["time"] - launched
        ranks = summary["ranks_initialised_s"] - summary.get("ranks_launch_s", 0.0)
        step = first["train/time_s"]
        coordinator = to_first_step - ranks - step
        own.append(coordinator)
        print(f"{repeat:>3} {to_first_step:>13.2f}s {ranks:>28.2f}s {step:>5.2f}s {coordinator:>11.2f}s")
    print(f"coordinator's own part: best {min(own):.2f}s, median {sorted(own)[len(own) // 2]:.2f}s (target ≤ 1 s); "
          "ray.init() + one actor alone: 3.9–6.1 s on these machines")


if __name__ == "__main__":
    main()
