"""Seconds per step of the colocated schedule beside the separated one, on the same model and batch, the swap
phases' share, and (on CUDA) the memory each phase holds.

Owns nothing but its measurement: the default job run with `rayless train` once per schedule — `colocated`
(`--colocate`), `resident` (`--colocate --no-offload-train --no-offload-rollout`), `separated` (on CUDA only
where two GPUs are visible) — each run's metrics.jsonl read back. The floor is the separated (or resident)
step of the same run; figures are medians over the steps after the first. What each schedule means and what is
measured on CUDA: docs/colocation.md.

    python -m bench.colocate [--device cpu|cuda] [--rollouts 4] [--hidden 64 --layers 2 --intermediate 128]

Exit 0 when every run finished and, in the colocated one, the engines held no weights while the ranks trained,
no request reached a released engine, and its step took at most --target × the floor's (default 3); else 1.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from workers.tiny_model import TinyModelSpec, build_tiny_model, count_parameters

PHASES = ("generate", "release", "onload", "train", "export", "offload", "resume_weights", "update", "resume_kv")
SWAP = ("release", "onload", "export", "offload", "resume_weights", "resume_kv")


def schedules(device: str, gpus: int) -> dict[str, list[str]]:
    """The flags of each schedule this machine can run."""
    if device == "cpu":
        engines = ["--rollout-num-engines", "1"]
        return {"colocated": [*engines, "--colocate"],
                "resident": [*engines, "--colocate", "--no-offload-train", "--no-offload-rollout"],
                "separated": engines}
    runs = {"colocated": ["--engine-backend", "rayless", "--colocate"],
            "resident": ["--engine-backend", "rayless", "--colocate", "--no-offload-train", "--no-offload-rollout"]}
    if gpus >= 2:
        runs["separated"] = ["--engine-backend", "rayless", "--rollout-num-gpus", "1"]
    return runs


def run_schedule(name: str, flags: list[str], model: Path, workdir: Path, args: argparse.Namespace) -> dict[str, Any]:
    run_dir = workdir / name
    command = [sys.executable, "-m", "coordinator.cli", "train", "--hf-checkpoint", str(model),
               "--prompt-data", "builtin:first_digit", "--rollout-batch-size", str(args.prompts),
               "--n-samples-per-prompt", str(args.samples), "--rollout-max-response-len", "4",
               "--num-rollout", str(args.rollouts), "--actor-num-gpus-per-node", "1", "--lr", "1e-3",
               "--no-progress", "--run-dir", str(run_dir), *flags]
    env = dict(os.environ)
    env.pop("RAYLESS_PLAN_GPU_COUNT", None)
    if args.device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""  # CPU schedules on a GPU machine too
    started = time.monotonic()
    done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout, check=False, env=env)
    wall = time.monotonic() - started
    if done.returncode != 0:
        print(f"--- {name} failed (exit {done.returncode}) ---\n{done.stderr[-3000:]}", file=sys.stderr)
        return {"name": name, "ok": False, "wall_s": wall}
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {"name": name, "ok": True, "wall_s": wall, "rows": rows}


def median(rows: list[dict[str, Any]], key: str) -> float | None:
    values = [row[key] for row in rows[1:] or rows if key in row]
    return statistics.median(values) if values else None


def report(results: list[dict[str, Any]], args: argparse.Namespace) -> int:
    by_name = {r["name"]: r for r in results}
    print(f"\n{'schedule':<12}{'step s':>9}{'gen s':>9}{'train s':>9}{'sync s':>9}{'swap s':>9}{'swap %':>9}"
          f"{'wall s':>9}")
    for result in results:
        if not result["ok"]:
            print(f"{result['name']:<12}  FAILED")
            continue
        rows = result["rows"]
        cells = [median(rows, key) for key in ("step/time_s", "rollout/time_s", "train/time_s", "sync/time_s",
                                                "colocate/swap_s")]
        share = median(rows, "colocate/swap_share")
        text = "".join(f"{c:>9.3f}" if c is not None else f"{'-':>9}" for c in cells)
        print(f"{result['name']:<12}{text}{(100 * share if share is not None else 0):>8.1f}%{result['wall_s']:>9.1f}")
    colocated = by_name.get("colocated")
    checks: list[tuple[str, bool]] = [(f"{r['name']} finished", r["ok"]) for r in results]
    if colocated and colocated["ok"]:
        rows = colocated["rows"]
        print("\ncolocated phases, median seconds per step (share of the step):")
        step = median(rows, "step/time_s") or 0.0
        for phase in PHASES:
            value = median(rows, f"colocate/{phase}_s")
            if value is not None:
                mark = "  swap" if phase in SWAP else ""
                print(f"  {phase:<15}{value:>9.3f}  ({100 * value / step if step else 0:5.1f}%){mark}")
        memory_report(rows)
        floor_name = "separated" if by_name.get("separated", {}).get("ok") else "resident"
        floor = by_name.get(floor_name)
        if floor and floor["ok"]:
            ratio = (median(rows, "step/time_s") or 0.0) / (median(floor["rows"], "step/time_s") or 1e-9)
            checks.append((f"colocated step / {floor_name} step = {ratio:.2f} (target ≤ {args.target})",
                           ratio <= args.target))
        checks.append(("engines held no weights while the ranks trained",
                       all(row.get("colocate/engine_weight_train_bytes", 1) == 0 for row in rows)))
        checks.append(("no request reached a released engine",
                       all(row.get("colocate/engine_requests_refused_while_released", 1) == 0 for row in rows)))
    print()
    for text, ok in checks:
        print(f"{text}: {'PASS' if ok else 'FAIL'}")
    return 0 if all(ok for _, ok in checks) else 1


def memory_report(rows: list[dict[str, Any]]) -> None:
    """Per phase, what the rank and the engine hold (the last step's figures; CUDA figures where on CUDA)."""
    row = rows[-1]
    mib = 2**20

    def show(label: str, key: str) -> None:
        if key in row:
            print(f"  {label:<58}{row[key] / mib:>10.1f} MiB")

    print("\ncolocated memory, last step:")
    show("rank state moved each step (params, grads, optimizer)", "colocate/rank_offload_state_bytes")
    show("rank peak allocated while generating (offloaded)", "colocate/rank_onload_cuda_previous_phase_peak_bytes")
    show("rank peak allocated while onloading", "colocate/rank_onload_cuda_peak_bytes")
    show("rank peak allocated while training", "colocate/rank_offload_cuda_previous_phase_peak_bytes")
    show("rank peak allocated while offloading", "colocate/rank_offload_cuda_peak_bytes")
    show("device in use before onload (rank + engine, both swapped out)", "colocate/rank_onload_before_device_used_bytes")
    show("device in use after onload (rank's state on it)", "colocate/rank_onload_device_used_bytes")
    show("device in use after the step, before offload", "colocate/rank_offload_before_device_used_bytes")
    show("device in use after offload", "colocate/rank_offload_device_used_bytes")
    show("engine CUDA allocated while generating", "colocate/engine_cuda_allocated_generate_bytes")
    show("engine CUDA allocated while the rank trains (released)", "colocate/engine_cuda_allocated_train_bytes")
    show("engine CUDA allocated once resumed", "colocate/engine_cuda_allocated_resumed_bytes")
    show("engine weights resident while generating", "colocate/engine_weight_generate_bytes")
    show("engine weights resident while the rank trains", "colocate/engine_weight_train_bytes")
    show("engine RSS while generating", "colocate/engine_rss_generate_bytes")
    show("engine RSS while the rank trains", "colocate/engine_rss_train_bytes")
    show("rank RSS offloaded", "colocate/rank_offload_rss_bytes")
    show("rank RSS onloaded", "colocate/rank_onload_rss_bytes")


def model_spec(hidden: int, layers: int, intermediate: int) -> TinyModelSpec:
    """The default job's model at its default sizes; otherwise heads of 64 dimensions, two per KV head."""
    default = TinyModelSpec()
    if (hidden, layers, intermediate) == (default.hidden_size, default.num_hidden_layers, default.intermediate_size):
        return default
    heads = max(1, hidden // 64)
    return TinyModelSpec(hidden_size=hidden, num_hidden_layers=layers, intermediate_size=intermediate,
                         num_attention_heads=heads, num_key_value_heads=max(1, heads // 2))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--rollouts", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=8, help="--rollout-batch-size")
    parser.add_argument("--samples", type=int, default=4, help="--n-samples-per-prompt")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--intermediate", type=int, default=128)
    parser.add_argument("--schedules", default=None, help="comma-separated subset of colocated,resident,separated")
    parser.add_argument("--target", type=float, default=3.0)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per run")
    parser.add_argument("--workdir", type=Path, default=None, help="keep the runs here (default: a temp dir)")
    parser.add_argument("--save-runs", type=Path, default=None,
                        help="copy each run's metrics.jsonl, plan.txt and summary.json here (small files only)")
    args = parser.parse_args()

    gpus = 0
    if args.device == "cuda":
        import torch

        gpus = torch.cuda.device_count()
        if gpus == 0:
            print("--device cuda: no CUDA device visible", file=sys.stderr)
            return 1
    runs = schedules(args.device, gpus)
    if args.schedules:
        wanted = args.schedules.split(",")
        runs = {name: flags for name, flags in runs.items() if name in wanted}
    with tempfile.TemporaryDirectory(prefix="rayless-colocate-bench-") as tmp:
        workdir = args.workdir or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        spec = model_spec(args.hidden, args.layers, args.intermediate)
        model = build_tiny_model(workdir / "model", spec)
        print(f"model: {count_parameters(model) / 1e6:.2f} M parameters; device {args.device}"
              f"{f' ({gpus} GPU(s) visible)' if gpus else ''}; {args.rollouts} rollouts of {args.prompts} prompts × "
              f"{args.samples} samples; schedules: {', '.join(runs)}")
        if args.device == "cuda" and gpus < 2:
            print("separated: skipped (the rank and the engine on different GPUs needs two)")
        results = [run_schedule(name, flags, model, workdir, args) for name, flags in runs.items()]
        if args.save_runs is not None:
            for name in runs:
                target = args.save_runs / name
                target.mkdir(parents=True, exist_ok=True)
                for file in ("metrics.jsonl", "plan.txt", "summary.json", "train_ranks.log"):
                    if (workdir / name / file).is_file():
                        shutil.copy(workdir / name / file, target / file)
    return report(results, args)


if __name__ == "__main__":
    sys.exit(main())
