"""Benchmark: load N rollout dumps in the rayless format beside torch.load of the same data saved slime-style.

Measures, in one run on the same samples: samples/s to load N dumps (ours whole, ours streaming, torch.load
weights_only=False as slime does it, torch.load weights_only=True (torch's safe mode), and our restricted
importer of the same .pt files), the ratio ours / torch, and peak traced Python memory (tracemalloc) for N = 1, 4, 16 files, showing that streaming stays flat
while loading everything grows with N. The floor (torch.load) is measured in the same run, never quoted.

    .venv/bin/python -m bench.replay_load [--samples-per-file 128] [--response-len 1024] [--files 1 4 16]

About 1.5 CPU-minutes with the defaults (torch.load weights_only=True dominates).
"""

from __future__ import annotations

import argparse
import gc
import random
import tempfile
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from replay.format import write_dump
from replay.reader import iter_samples, read_dump
from replay.sample import Sample, SampleStatus
from replay.torch_import import import_torch_dump


def make_samples(rollout_id: int, count: int, response_len: int, n_per_prompt: int = 8) -> list[Sample]:
    rng = random.Random(rollout_id)
    samples = []
    for i in range(count):
        prompt_len = rng.randint(64, 512)
        length = rng.randint(response_len // 2, response_len * 3 // 2)
        samples.append(
            Sample(
                group_index=i // n_per_prompt,
                sample_index=i % n_per_prompt,
                prompt="Solve: " + "x" * rng.randint(100, 800),
                tokens=[rng.randrange(151_000) for _ in range(prompt_len + length)],
                response_length=length,
                loss_mask=[1] * length,
                rollout_log_probs=[-rng.random() * 3 for _ in range(length)],
                reward=float(rng.random() < 0.5),
                status=SampleStatus.COMPLETED,
                weight_versions=[str(rollout_id)],
                label="42",
                response="y" * rng.randint(200, 3000),
                advantage=rng.gauss(0, 1),
                metadata={"source": "bench"},
            )
        )
    return samples


def slime_dict(sample: Sample) -> dict[str, Any]:
    """What slime's `Sample.to_dict()` puts in its `.pt` dumps: plain lists, the status as its value."""
    return {
        "index": sample.group_index * 8 + sample.sample_index,
        "group_index": sample.group_index,
        "prompt": sample.prompt,
        "tokens": sample.tokens,
        "response": sample.response,
        "response_length": sample.response_length,
        "label": sample.label,
        "reward": sample.reward,
        "loss_mask": sample.loss_mask,
        "rollout_log_probs": sample.rollout_log_probs,
        "status": sample.status.value,
        "metadata": sample.metadata,
        "weight_versions": sample.weight_versions,
    }


def best_of(repeats: int, fn: Callable[[], int]) -> tuple[float, int]:
    best, count = float("inf"), 0
    for _ in range(repeats):
        gc.collect()
        start = time.perf_counter()
        count = fn()
        best = min(best, time.perf_counter() - start)
    return best, count


def peak_bytes(fn: Callable[[], Any]) -> int:
    gc.collect()
    tracemalloc.start()
    try:
        result = fn()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    del result
    return peak


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples-per-file", type=int, default=128)
    parser.add_argument("--response-len", type=int, default=1024)
    parser.add_argument("--files", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    max_files = max(args.files)

    with tempfile.TemporaryDirectory(prefix="rayless-bench-") as tmp:
        ours, theirs = [], []
        for rollout_id in range(max_files):
            samples = make_samples(rollout_id, args.samples_per_file, args.response_len)
            ours.append(write_dump(Path(tmp, f"{rollout_id}.rld"), rollout_id, samples, config_facts={}))
            pt = Path(tmp, f"{rollout_id}.pt")
            torch.save({"rollout_id": rollout_id, "samples": [slime_dict(s) for s in samples]}, pt)
            theirs.append(pt)
        size_ours = sum(p.stat().st_size for p in ours) / max_files
        size_pt = sum(p.stat().st_size for p in theirs) / max_files
        tokens = sum(len(s.tokens) for s in read_dump(ours[0]).samples) / args.samples_per_file
        print(
            f"{args.samples_per_file} samples/file, ~{tokens:.0f} tokens/sample; file size: ours "
            f"{size_ours / 1e6:.2f} MB, torch.save {size_pt / 1e6:.2f} MB"
        )

        def ours_whole(n: int) -> int:
            return sum(len(read_dump(p).samples) for p in ours[:n])

        def ours_stream(n: int) -> int:
            return sum(1 for p in ours[:n] for _ in iter_samples(p))

        def torch_unsafe(n: int) -> int:
            return sum(len(torch.load(p, weights_only=False)["samples"]) for p in theirs[:n])

        def torch_safe(n: int) -> int:
            return sum(len(torch.load(p, weights_only=True)["samples"]) for p in theirs[:n])

        def ours_import(n: int) -> int:
            return sum(len(import_torch_dump(p)[1]) for p in theirs[:n])

        readers = {
            "ours read_dump (Samples, checked)": ours_whole,
            "ours iter_samples (streaming)": ours_stream,
            "torch.load weights_only=False (slime)": torch_unsafe,
            "torch.load weights_only=True": torch_safe,
            "ours import of the .pt (restricted, Samples)": ours_import,
        }
        n = max_files
        print(f"\nthroughput, {n} files ({n * args.samples_per_file} samples), best of {args.repeats}:")
        rates: dict[str, float] = {}
        for name, fn in readers.items():
            seconds, count = best_of(args.repeats, lambda fn=fn: fn(n))
            rates[name] = count / seconds
            print(f"  {name:46s} {rates[name]:10.0f} samples/s  ({seconds:.3f} s)")
        floor = rates["torch.load weights_only=False (slime)"]
        print(
            f"  ratio ours read_dump / torch.load(slime):     {rates['ours read_dump (Samples, checked)'] / floor:.2f}x"
        )
        print(
            f"  ratio ours iter_samples / torch.load(slime):  {rates['ours iter_samples (streaming)'] / floor:.2f}x"
        )
        print(
            f"  ratio ours read_dump / torch.load(weights_only=True): "
            f"{rates['ours read_dump (Samples, checked)'] / rates['torch.load weights_only=True']:.2f}x"
        )

        print("\npeak traced memory (tracemalloc) by number of files:")
        print(f"  {'files':>5}  {'ours streaming':>15}  {'ours all in memory':>19}  {'torch.load all':>15}")
        for count in args.files:

            def keep_ours(count: int = count) -> list[Any]:
                return [read_dump(p) for p in ours[:count]]

            def keep_torch(count: int = count) -> list[Any]:
                return [torch.load(p, weights_only=False) for p in theirs[:count]]

            stream = peak_bytes(lambda count=count: ours_stream(count))
            whole = peak_bytes(keep_ours)
            loaded = peak_bytes(keep_torch)
            print(f"  {count:>5}  {stream / 1e6:12.2f} MB  {whole / 1e6:16.2f} MB  {loaded / 1e6:12.2f} MB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
