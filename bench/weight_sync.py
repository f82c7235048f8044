"""Seconds to push a ~50M-parameter model from the training ranks to 2 CPU engines, by disk and by distributed.

Owns nothing but its measurement. The floor, measured in the same run on the same tensors, is one safetensors
save plus one load in this process: the least any disk-based sync must do. `disk` is TrainGroup.export_weights
(rank 0 writes an atomic snapshot) followed by `/update_weights_from_disk` on every engine concurrently;
`distributed` is rank 0 joining a fresh gloo group with the engines and broadcasting every tensor while the
engines receive them (`/init_weights_update_group` + `/update_weights_from_distributed`), then the group is
destroyed. Both end when every engine answered; each engine is then asked for its weight version.

    .venv/bin/python -m bench.weight_sync [--hidden 640 --layers 8 --intermediate 2560] [--repeats 3]

Exit code 0 when disk ≤ --target × floor (default 1.5), 1 otherwise.
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
import torch

from coordinator.engines.client import EngineClient
from coordinator.engines.launch import free_port
from coordinator.train.group import TrainGroup
from tests.support.engine_proc import start_engine_process
from workers.tiny_model import TinyModelSpec, build_tiny_model, count_parameters


def measure_floor(model_dir: Path, scratch: Path, repeats: int) -> tuple[list[float], list[float]]:
    """(save + load, save + load + copy into resident tensors) per repeat.

    `load_file` maps the file and may not touch the data, so the first figure is close to one save; the
    second adds the copy any engine must make into its parameters, shown for context (no target on it).
    """
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(model_dir / "model.safetensors"))
    resident = {name: torch.empty_like(tensor) for name, tensor in tensors.items()}
    floor, materialised = [], []
    for index in range(repeats):
        target = scratch / f"floor-{index}.safetensors"
        started = time.perf_counter()
        save_file(tensors, str(target), metadata={"format": "pt"})
        loaded = load_file(str(target))
        floor.append(time.perf_counter() - started)
        for name, tensor in loaded.items():
            resident[name].copy_(tensor)
        materialised.append(time.perf_counter() - started)
        target.unlink()
    return floor, materialised


async def push_by_disk(
    group: TrainGroup, client: EngineClient, urls: list[str], directory: Path, version: str
) -> dict[str, float]:
    started = time.perf_counter()
    path = await group.export_weights(directory, version, keep=2)
    exported = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for url in urls:
            tg.start_soon(
                lambda url=url: client.engine(url).update_weights_from_disk(str(path), weight_version=version)
            )
    finished = time.perf_counter()
    return {"total": finished - started, "export": exported - started, "load": finished - exported}


async def push_by_distributed(
    group: TrainGroup, client: EngineClient, urls: list[str], version: str
) -> dict[str, float]:
    started = time.perf_counter()
    manifest = await group.weight_manifest()
    names = [name for name, _, _ in manifest]
    dtypes = [dtype for _, dtype, _ in manifest]
    shapes = [shape for _, _, shape in manifest]
    port = free_port("127.0.0.1")
    world_size = 1 + len(urls)
    group_name = f"bench_{version}"

    async def engine_side(index: int, url: str) -> None:
        api = client.engine(url)
        await api.init_weights_update_group(
            master_address="127.0.0.1",
            master_port=port,
            rank_offset=1 + index,
            world_size=world_size,
            group_name=group_name,
            backend="gloo",
        )
        await api.update_weights_from_distributed(
            names=names, dtypes=dtypes, shapes=shapes, group_name=group_name, weight_version=version
        )

    async with anyio.create_task_group() as tg:
        tg.start_soon(
            lambda: group.broadcast_weights(
                master_address="127.0.0.1", master_port=port, world_size=world_size, group_name=group_name
            )
        )
        for index, url in enumerate(urls):
            tg.start_soon(engine_side, index, url)
    finished = time.perf_counter()
    await group.destroy_weight_group(group_name)
    async with anyio.create_task_group() as tg:
        for url in urls:
            tg.start_soon(lambda url=url: client.engine(url).destroy_weights_update_group(group_name))
    return {"total": finished - started}


async def check_versions(client: EngineClient, urls: list[str], version: str) -> None:
    for url in urls:
        got = await client.engine(url).get_weight_version()
        if got != version:
            raise RuntimeError(f"engine {url} reports weight version {got!r}, expected {version!r}")


async def run_bench(
    model_dir: Path, scratch: Path, urls: list[str], args: argparse.Namespace
) -> dict[str, list[dict[str, float]]]:
    results: dict[str, list[dict[str, float]]] = {"disk": [], "distributed": []}
    snapshots = (
        args.snapshot_dir / f"rayless-bench-{os.getpid()}" if args.snapshot_dir else scratch / "snapshots"
    )
    async with anyio.create_task_group() as tg:
        group: TrainGroup = await tg.start(
            TrainGroup(nproc_per_node=args.ranks, run_dir=scratch / "run", torch_threads=args.threads).run
        )
        await group.init({"model_path": str(model_dir), "lr": 0.0})
        async with EngineClient(max_connections=8, read_timeout=600.0) as client:
            for repeat in range(args.repeats):
                version = f"disk-{repeat}"
                results["disk"].append(
                    await push_by_disk(group, client, urls, scratch / "snapshots", version)
                )
                await check_versions(client, urls, version)
                version = f"dist-{repeat}"
                results["distributed"].append(await push_by_distributed(group, client, urls, version))
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
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--target", type=float, default=1.5)
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
        size_mb = (model_dir / "model.safetensors").stat().st_size / 1e6
        print(
            f"model: {parameters / 1e6:.1f} M parameters, {size_mb:.0f} MB float32; {args.engines} engines, {args.ranks} rank(s)"
        )
        floor, materialised = measure_floor(model_dir, scratch, args.repeats)
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
        ("distributed (gloo broadcast)", dist_s, [r["total"] for r in results["distributed"]]),
    ]
    for name, value, runs in rows:
        print(f"{name:<34}{value:>10.3f}{value / floor_s:>10.2f}   {', '.join(f'{x:.3f}' for x in runs)}")
    ok = disk_s <= args.target * floor_s
    print(f"disk / floor = {disk_s / floor_s:.2f} (target ≤ {args.target}): {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
