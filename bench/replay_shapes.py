"""The rank's peak memory on a replayed step at RL lengths: `rayless train --load-debug-rollout-data` (the real
CLI: coordinator, torchrun, one CPU rank) on a dump of N samples × L tokens, with Qwen3's 151,936-token
vocabulary on a Qwen3-shaped model of hidden size 64 and 2 layers (issue 20's must-show: 8 × 8,192 tokens at
most 3 GiB; before the chunked logprobs, 8 × 1,024 passed 6 GiB).

The peak is the largest resident set of any process of the run (`RUSAGE_CHILDREN` of the CLI after it exits:
torchrun waits for its rank, the CLI for torchrun, so the rank's high-water mark is included); the rank is by
far the largest. Memory is per micro-batch, so the longer shapes need fewer samples (--samples).

    python -m bench.replay_shapes [--shapes 8x8192,2x16384,1x32768] [--target-gib 3]

Exit 0 when the first shape peaks at most --target-gib.
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

from bench.shapes_parts import QWEN3_VOCAB, build_model


def write_dump(directory: Path, count: int, length: int, seed: int) -> str:
    from replay.format import dump_path, write_dump
    from replay.sample import Sample, SampleStatus

    rng = random.Random(seed)
    template = str(directory / "{rollout_id}.rld")
    prompt = 256
    response = length - prompt
    samples = [Sample(group_index=0, sample_index=k, prompt="p", tokens=[rng.randrange(QWEN3_VOCAB)
                                                                         for _ in range(length)],
                      response_length=response, loss_mask=[1] * response, rollout_log_probs=[-11.9] * response,
                      reward=float(k % 2), status=SampleStatus.COMPLETED, weight_versions=["0"])
               for k in range(count)]
    write_dump(dump_path(template, 0), 0, samples, config_facts={})
    return template


def replay_peak(model: Path, work: Path, count: int, length: int) -> dict[str, float]:
    """Run the replay in a fresh child of a fresh child, so RUSAGE_CHILDREN is this run's alone."""
    template = write_dump(work / f"dumps-{count}x{length}", count, length, seed=length)
    run_dir = work / f"run-{count}x{length}"
    rayless = str(Path(sys.executable).parent / "rayless")
    command = [rayless, "train", "--hf-checkpoint", str(model), "--load-debug-rollout-data", template,
               "--num-rollout", "1", "--actor-num-gpus-per-node", "1", "--n-samples-per-prompt", str(count),
               "--rollout-batch-size", "1", "--run-dir", str(run_dir), "--no-progress"]
    probe = ("import json, resource, subprocess, sys, time; started = time.time(); "
             "done = subprocess.run(sys.argv[1:], capture_output=True, text=True); "
             "print(json.dumps({'rc': done.returncode, 'maxrss_kib': resource.getrusage("
             "resource.RUSAGE_CHILDREN).ru_maxrss, 'seconds': time.time() - started, 'tail': done.stderr[-3000:]}))")
    done = subprocess.run([sys.executable, "-c", probe, *command], capture_output=True, text=True, check=True,
                          env={**os.environ, "MPLBACKEND": "Agg"})
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if result["rc"] != 0:
        raise SystemExit(f"replay of {count}x{length} failed (exit {result['rc']}):\n{result['tail']}")
    metrics = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])
    return {"peak_gib": result["maxrss_kib"] / 2**20, "seconds": result["seconds"],
            "step_s": float(metrics.get("train/time_s", 0.0)), "tokens": count * length}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="8x8192,2x16384,1x32768", help="SAMPLESxTOKENS,...")
    parser.add_argument("--target-gib", type=float, default=3.0)
    options = parser.parse_args()
    shapes = [tuple(int(part) for part in item.split("x")) for item in options.shapes.split(",")]
    with tempfile.TemporaryDirectory() as work_dir:
        work = Path(work_dir)
        model = build_model(work / "model", hidden=64, layers=2, intermediate=192, heads=4, kv_heads=2,
                            vocab_size=QWEN3_VOCAB)
        peaks = []
        print(f"{'shape':>12} {'peak (rank)':>12} {'train step':>11} {'whole run':>10}")
        for count, length in shapes:
            started = time.time()
            figures = replay_peak(model, work, count, length)
            peaks.append(figures["peak_gib"])
            print(f"{count:>3} × {length:>6} {figures['peak_gib']:>10.2f} GiB {figures['step_s']:>10.1f}s "
                  f"{time.time() - started:>9.1f}s", flush=True)
    ok = peaks[0] <= options.target_gib
    print(f"{shapes[0][0]} × {shapes[0][1]} tokens peaks at {peaks[0]:.2f} GiB (target ≤ {options.target_gib} GiB): "
          f"{'PASS' if ok else 'FAIL'}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
