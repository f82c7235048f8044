"""Seconds to push a ~50M-parameter model from the training ranks to 2 CPU engines, by disk and by distributed,
and how much rank 0's memory grows during a distributed sync.

Owns nothing but its measurement. The floor, measured in the same run on the same tensors, is one safetensors
save plus one load in this process: the least any disk-based sync must do. `disk` is TrainGroup.export_weights
(rank 0 writes an atomic snapshot) followed by `/update_weights_from_disk` on every engine concurrently;
`distributed` is the coordinator's own `DistributedUpdate`: rank 0 and the engines form a fresh gloo group,
then rank 0 sends buckets of at most --bucket-mib (flattened; the next gathered while the last is on the
wire) and every engine takes one `/update_weights_from_distributed` per bucket inside a begin/end session; then
the group is destroyed. Both end when every engine answered; each engine is then asked for its weight version.
During each distributed sync rank 0's RSS is sampled every few milliseconds: its growth over the RSS just
before is what the sync cost in host memory (a full copy of the model would show as the model's size).

    .venv/bin/python -m bench.weight_sync [--hidden 640 --layers 8 --intermediate 2560] [--repeats 5]

Exit code 0 when every target holds, 1 otherwise: disk ≤ --disk-target × floor (1.3), distributed ≤
--distributed-target × floor (2.0), rank 0's RSS growth ≤ one bucket + --rss-model-fraction (0.2) × the model's
bytes.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio
import psutil
import torch

from coordinator.engines.client import EngineClient
from coordinator.train.group import TrainGroup
from coordinator.train.torchrun import TorchrunSpec
from coordinator.weights.distributed import FLATTENED_BUCKET, DistributedUpdate
from tests.support.engine_proc import start_engine_process
from tests.support.train_settings import flat_settings
from workers.tiny_model import TinyModelSpec, build_tiny_model, count_parameters


class Floor:
    """One safetensors save + load of the model's tensors in this process, measured between the syncs.

    `load_file` maps the file and may not touch the data, so the figure is close to one save; `materialised`
    adds the copy any engine must make into its parameters, shown for context (no target on it). Measured in
    every repeat, beside the syncs, because this machine's memory bandwidth swings by several times from one
    second to the next: a floor taken before the engines started would compare different moments.
    """

    def __init__(self, model_dir: Path, scratch: Path) -> None:
        from safetensors.torch import load_file

        self.scratch = scratch
        self.tensors = load_file(str(model_dir / "model.safetensors"))
        self.resident = {name: torch.empty_like(tensor) for name, tensor in self.tensors.items()}

    def measure(self, index: int) -> dict[str, float]:
        from safetensors.torch import load_file, save_file

        target = self.scratch / f"floor-{index}.safetensors"
        started = time.perf_counter()
        save_file(self.tensors, str(target), metadata={"format": "pt"})
        loaded = load_file(str(target))
        floor = time.perf_counter() - started
        for name, tensor in loaded.items():
            self.resident[name].copy_(tensor)
        materialised = time.perf_counter() - started
        target.unlink()
        return {"total": floor, "materialised": materialised}


async def push_by_disk(
    group: TrainGroup, client: EngineClient, urls: list[str], directory: Path, version: str
) -> dict[str, float]:
    started = time.perf_counter()
    path = await group.commands.export_weights(directory, version, keep=2)
    exported = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for url in urls:
            tg.start_soon(
                lambda url=url: client.engine(url).update_weights_from_disk(str(path), weight_version=version)
            )
    finished = time.perf_counter()
    return {"total": finished - started, "export": exported - started, "load": finished - exported}


class Engine:
    """What DistributedUpdate needs of an engine handle."""

    def __init__(self, index: int, url: str) -> None:
        self.name, self.url, self.tp_size = f"bench-{index}", url, 1


async def sample_rss(pid: int, peak: list[int], period_s: float = 0.002) -> None:
    process = psutil.Process(pid)
    while True:
        peak[0] = max(peak[0], process.memory_info().rss)
        await anyio.sleep(period_s)


async def push_by_distributed(
    group: TrainGroup, client: EngineClient, urls: list[str], version: str, bucket_bytes: int
) -> dict[str, float]:
    update = DistributedUpdate(client=client, trainer=group.commands, host="127.0.0.1", backend="gloo",
                               bucket_bytes=bucket_bytes, load_format=FLATTENED_BUCKET, join_timeout_s=120)
    rank0 = psutil.Process(group.ranks[0].pid)
    before = rank0.memory_info().rss
    peak = [before]
    started = time.perf_counter()
    async with anyio.create_task_group() as tg:
        tg.start_soon(sample_rss, rank0.pid, peak)
        await update.run([Engine(i, url) for i, url in enumerate(urls)], version)
        finished = time.perf_counter()
        tg.cancel_scope.cancel()
    return {"total": finished - started, "rss_growth": float(peak[0] - before)}


async def check_versions(client: EngineClient, urls: list[str], version: str) -> None:
    for url in urls:
        got = await client.engine(url).get_weight_version()
        if got != version:
            raise RuntimeError(f"engine {url} reports weight version {got!r}, expected {version!r}")


async def run_bench(
    model_dir: Path, scratch: Path, urls: list[str], args: argparse.Namespace
) -> dict[str, list[dict[str, float]]]:
    results: dict[str, list[dict[str, float]]] = {"floor": [], "disk": [], "distributed": []}
    floor = Floor(model_dir, scratch)
    snapshots = (
        args.snapshot_dir / f"rayless-bench-{os.getpid()}" if args.snapshot_dir else scratch / "snapshots"
    )
    async with anyio.create_task_group() as tg:
        group: TrainGroup = await tg.start(
            TrainGroup(TorchrunSpec(nproc_per_node=args.ranks), run_dir=scratch / "run", torch_threads=args.threads).run
        )
        await group.commands.init(flat_settings({"model_path": str(model_dir), "lr": 0.0}))
        async with EngineClient(max_connections=8, read_timeout=600.0) as client:
            for repeat in range(args.repeats):
                results["floor"].append(await anyio.to_thread.run_sync(floor.measure, repeat))
                version = f"disk-{repeat}"
                results["disk"].append(await push_by_disk(group, client, urls, snapshots, version))
                await check_versions(client, urls, version)
                version = f"dist-{repeat}"
                results["distributed"].append(
                    await push_by_distributed(group, client, urls, version, args.bucket_mib * 1024**2)
                )
                await check_versions(client, urls, version)
        await group.shutdown()
    if args.snapshot_dir:
        shutil.rmtree(snapshots, ignore_errors=True)
    return results


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--hidden", type=int, default=640)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--intermediate", type=int, default=2560)
    parser.add_argument("--engines", type=int, default=2)
    parser.add_argument("--ranks", type=int, default=1, help="training ranks (only rank 0 sends weights)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--bucket-mib", type=int, default=16, help="--update-weight-buffer-size, in MiB")
    parser.add_argument("--disk-target", type=float, default=1.3)
    parser.add_argument("--distributed-target", type=float, default=2.0)
    parser.add_argument("--rss-model-fraction", type=float, default=0.2)
    parser.add_argument(
        "--snapshot-dir",
        type=Path,
        default=None,
        help="where rank 0 writes snapshots (default: a temp dir; try /dev/shm)",
    )
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="rayless-weight-sync-") as tmp:
        scratch = Path(tmp)
        spec = TinyModelSpec(
            hidden_size=args.hidden,
            num_hidden_layers=args.layers,
            intermediate_size=args.intermediate,
            num_attention_heads=args.hidden // 64,
            num_key_value_heads=max(1, args.hidden // 128),
        )
        model_dir = build_tiny_model(scratch / "model", spec)
        parameters = count_parameters(model_dir)
        model_bytes = (model_dir / "model.safetensors").stat().st_size
        size_mb = model_bytes / 1e6
        print(
            f"model: {parameters / 1e6:.1f} M parameters, {size_mb:.0f} MB float32; {args.engines} engines, {args.ranks} rank(s)"
        )
        with contextlib.ExitStack() as stack:
            engines = [
                stack.enter_context(
                    start_engine_process(
                        model_dir, threads=args.threads, log_path=scratch / f"engine-{i}.log"
                    )
                )
                for i in range(args.engines)
            ]
            results = anyio.run(run_bench, model_dir, scratch, [engine.url for engine in engines], args)

    return report(args, results, model_bytes)


def report(args: argparse.Namespace, results: dict[str, list[dict[str, float]]], model_bytes: int) -> int:
    floor = [r["total"] for r in results["floor"]]
    materialised = [r["materialised"] for r in results["floor"]]
    floor_s = statistics.median(floor)
    disk_s = statistics.median(r["total"] for r in results["disk"])
    dist_s = statistics.median(r["total"] for r in results["distributed"])
    export_s = statistics.median(r["export"] for r in results["disk"])
    load_s = statistics.median(r["load"] for r in results["disk"])
    print(f"{'path':<34}{'median s':>10}{'× floor':>10}   runs")
    rows: list[tuple[str, float, list[Any]]] = [
        ("floor (1 save + 1 load)", floor_s, floor),
        ("  floor + copy into memory", statistics.median(materialised), materialised),
        ("disk (export + engines load)", disk_s, [r["total"] for r in results["disk"]]),
        ("  of which rank-0 export", export_s, [r["export"] for r in results["disk"]]),
        ("  of which engines load", load_s, [r["load"] for r in results["disk"]]),
        (f"distributed (gloo, {args.bucket_mib} MiB buckets)", dist_s, [r["total"] for r in results["distributed"]]),
    ]
    for name, value, runs in rows:
        print(f"{name:<34}{value:>10.3f}{value / floor_s:>10.2f}   {', '.join(f'{x:.3f}' for x in runs)}")
    mib = 1024**2
    growth = max(r["rss_growth"] for r in results["distributed"])
    budget = args.bucket_mib * mib + args.rss_model_fraction * model_bytes
    runs = ", ".join(f"{r['rss_growth'] / mib:.1f}" for r in results["distributed"])
    print(f"rank 0 RSS growth during a distributed sync: max {growth / mib:.1f} MiB over runs {runs} "
          f"(model {model_bytes / mib:.0f} MiB; budget one bucket + {args.rss_model_fraction:.0%} = {budget / mib:.1f} MiB)")
    checks = [
        (f"disk / floor = {disk_s / floor_s:.2f} (target ≤ {args.disk_target})", disk_s <= args.disk_target * floor_s),
        (f"distributed / floor = {dist_s / floor_s:.2f} (target ≤ {args.distributed_target})",
         dist_s <= args.distributed_target * floor_s),
        (f"rank 0 RSS growth = {growth / mib:.1f} MiB (target ≤ {budget / mib:.1f} MiB)", growth <= budget),
    ]
    for text, ok in checks:
        print(f"{text}: {'PASS' if ok else 'FAIL'}")
    return 0 if all(ok for _, ok in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
