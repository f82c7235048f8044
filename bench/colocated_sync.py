"""Seconds of a colocated weight sync — one rank and our engine on the same device, the snapshot through tmpfs
— against a floor measured in the same run on the same bytes.

Owns nothing but its measurement. The sync is what a colocated run does each step (`WeightSync` in disk mode,
`coordinator.plan.snapshots`): rank 0 writes a safetensors snapshot of the whole model to a private directory
under /dev/shm (`TrainGroup.export_weights`: a full state dict gathered to host memory, then saved), and the
engine loads it (`/update_weights_from_disk`: read, then copied into its parameters on its device); the engine
is then asked for its weight version. The floor is what any disk sync of these bytes must do, in this
process: the tensors copied from the device to host memory (on CUDA), one safetensors save to the same
tmpfs and one load; the copy back to the device is shown beside it. NCCL is not an option here: a rank and an
engine on the same GPU cannot form an NCCL group.

    python -m bench.colocated_sync [--device cuda] [--hidden 1024 --layers 40 --intermediate 3072] [--repeats 3]

On CUDA the default model is Qwen3-shaped with ~0.5 B parameters (its exact count is printed). Exit 0 when
the sync takes at most --target × the floor (default 3) and the engine reports each version; 1 otherwise.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio

from bench.colocate import model_spec
from coordinator.engines.client import EngineClient
from coordinator.plan.snapshots import TMPFS
from coordinator.train.group import TrainGroup
from coordinator.train.torchrun import TorchrunSpec
from tests.support.engine_proc import start_engine_process
from tests.support.train_settings import flat_settings
from workers.tiny_model import build_tiny_model, count_parameters


class Floor:
    """Device → host copy + one safetensors save to tmpfs + one load, of the model's own tensors."""

    def __init__(self, model_dir: Path, scratch: Path, device: str) -> None:
        import torch
        from safetensors.torch import load_file

        torch.set_num_threads(1)  # the rank and the engine have their own threads; no spinning pool beside them
        self.torch = torch
        self.device = device
        self.scratch = scratch
        self.tensors = {name: tensor.to(device) for name, tensor in load_file(str(model_dir / "model.safetensors")).items()}

    def measure(self, index: int) -> dict[str, float]:
        from safetensors.torch import load_file, save_file

        torch = self.torch
        target = self.scratch / f"floor-{index}.safetensors"
        started = time.perf_counter()
        host = {name: tensor.to("cpu") for name, tensor in self.tensors.items()}
        if self.device == "cuda":
            torch.cuda.synchronize()
        copied = time.perf_counter()
        save_file(host, str(target), metadata={"format": "pt"})
        saved = time.perf_counter()
        loaded = load_file(str(target))
        for tensor in loaded.values():  # touch every page: the engine reads them all
            tensor.sum()
        floor = time.perf_counter()
        for name, tensor in loaded.items():
            self.tensors[name].copy_(tensor)
        if self.device == "cuda":
            torch.cuda.synchronize()
        back = time.perf_counter()
        target.unlink()
        return {"total": floor - started, "to_host": copied - started, "save": saved - copied,
                "load": floor - saved, "to_device": back - floor}


async def sync_once(group: TrainGroup, client: EngineClient, url: str, directory: Path, version: str) -> dict[str, float]:
    started = time.perf_counter()
    path = await group.commands.export_weights(directory, version, keep=2)
    exported = time.perf_counter()
    await client.engine(url).update_weights_from_disk(str(path), weight_version=version, flush_cache=True)
    loaded = time.perf_counter()
    got = await client.engine(url).get_weight_version()
    if got != version:
        raise RuntimeError(f"the engine reports weight version {got!r} after the sync, expected {version!r}")
    return {"total": loaded - started, "export": exported - started, "load": loaded - exported}


async def run_bench(model_dir: Path, scratch: Path, snapshots: Path, url: str,
                    args: argparse.Namespace) -> dict[str, list[dict[str, float]]]:
    results: dict[str, list[dict[str, float]]] = {"floor": [], "sync": []}
    floor = Floor(model_dir, snapshots, args.device)
    env = {"CUDA_VISIBLE_DEVICES": ""} if args.device == "cpu" else {}
    async with anyio.create_task_group() as tg:
        group: TrainGroup = await tg.start(
            TrainGroup(TorchrunSpec(nproc_per_node=1), run_dir=scratch / "run", extra_env=env, torch_threads=args.threads).run)
        info = await group.commands.init(flat_settings({"model_path": str(model_dir), "lr": 0.0}))
        print(f"rank on {info.device}")
        async with EngineClient(max_connections=4, read_timeout=900.0) as client:
            for repeat in range(args.repeats):
                results["floor"].append(await anyio.to_thread.run_sync(floor.measure, repeat))
                results["sync"].append(await sync_once(group, client, url, snapshots / "weights", str(repeat + 1)))
        await group.shutdown()
        tg.cancel_scope.cancel()
    return results


def report(results: dict[str, list[dict[str, float]]], model_bytes: int, args: argparse.Namespace) -> int:
    def med(kind: str, key: str) -> float:
        return statistics.median(r[key] for r in results[kind])

    def runs(kind: str, key: str) -> str:
        return ", ".join(f"{r[key]:.3f}" for r in results[kind])

    floor_s, sync_s = med("floor", "total"), med("sync", "total")
    print(f"{'path':<44}{'median s':>10}{'× floor':>9}   runs")
    rows = [("floor: to host + save + load (tmpfs)", "floor", "total"),
            ("  of which device → host", "floor", "to_host"), ("  of which save", "floor", "save"),
            ("  of which load", "floor", "load"), ("  then host → device (not in the floor)", "floor", "to_device"),
            ("colocated sync: export + engine load", "sync", "total"),
            ("  of which rank-0 export (gather + save)", "sync", "export"),
            ("  of which engine load (read + to device)", "sync", "load")]
    for label, kind, key in rows:
        value = med(kind, key)
        print(f"{label:<44}{value:>10.3f}{value / floor_s:>9.2f}   {runs(kind, key)}")
    gib = model_bytes / 2**30
    print(f"model bytes {model_bytes / 2**20:.0f} MiB: sync {gib / sync_s:.2f} GiB/s, floor {gib / floor_s:.2f} GiB/s")
    ok = sync_s <= args.target * floor_s
    print(f"colocated sync / floor = {sync_s / floor_s:.2f} (target ≤ {args.target}): {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--hidden", type=int, default=None, help="default: 1024 on CUDA, 256 on CPU")
    parser.add_argument("--layers", type=int, default=None, help="default: 40 on CUDA, 4 on CPU")
    parser.add_argument("--intermediate", type=int, default=None, help="default: 3072 on CUDA, 768 on CPU")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the rank")
    parser.add_argument("--target", type=float, default=3.0)
    args = parser.parse_args()
    cuda = args.device == "cuda"
    spec = model_spec(args.hidden or (1024 if cuda else 256), args.layers or (40 if cuda else 4),
                      args.intermediate or (3072 if cuda else 768))
    tmpfs_root = TMPFS if TMPFS.is_dir() and os.access(TMPFS, os.W_OK) else None
    with tempfile.TemporaryDirectory(prefix="rayless-colocated-sync-") as tmp, \
            tempfile.TemporaryDirectory(prefix="rayless-colocated-sync-", dir=tmpfs_root) as snapshots:
        scratch = Path(tmp)
        started = time.perf_counter()
        model_dir = build_tiny_model(scratch / "model", spec)
        parameters = count_parameters(model_dir)
        model_bytes = (model_dir / "model.safetensors").stat().st_size
        print(f"model: Qwen3-shaped, hidden {spec.hidden_size}, {spec.num_hidden_layers} layers, intermediate "
              f"{spec.intermediate_size}: {parameters / 1e6:,.1f} M parameters, {model_bytes / 2**20:.0f} MiB "
              f"float32 (built in {time.perf_counter() - started:.1f}s); snapshots in {snapshots}"
              f"{'' if tmpfs_root else ' (no /dev/shm here: a temp dir)'}")
        extra: list[str] = ["--device", "cuda", "--base-gpu-id", "0"] if cuda else []
        with start_engine_process(model_dir, extra_args=extra, log_path=scratch / "engine.log",
                                  startup_timeout_s=600.0) as engine:
            results: Any = anyio.run(run_bench, model_dir, scratch, Path(snapshots), engine.url, args)
        shutil.rmtree(Path(snapshots) / "weights", ignore_errors=True)
    return report(results, model_bytes, args)


if __name__ == "__main__":
    sys.exit(main())
