"""The colocated swap of a training rank: seconds to offload and onload its whole state (parameters, gradients,
AdamW state) against the host↔device bandwidth measured in the same run (issue 20 item 6).

Owns nothing but its measurement. A real `Trainer` (one rank, world of 1) trains one step on a Qwen3-shaped
model, so every state tensor exists, then `offload` / `onload` run as the coordinator's commands run them
(`StateOffload`: on CUDA non-blocking copies through pinned host memory, one synchronize; on CPU a spill file).
The floor on CUDA: one flat buffer of the state's bytes copied device → pinned host and back, non-blocking,
timed with a synchronize; the swap's goal is ≥ 0.5× that bandwidth. On CPU there is no device link: the figures
are reported beside a safetensors save + load of the same bytes, with no target.

    python -m bench.offload_bandwidth [--device cuda] [--hidden 768 --layers 12 --intermediate 2048] [--repeats 3]

Exit 0 when every onload is bit-identical (digests) and, on CUDA, both directions reach --target × the floor.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

from tests.support.train_settings import init_command


def floor_gbps(state_bytes: int, device_name: str, repeats: int) -> tuple[float, float]:
    """(device→host, host→device) GB/s of one flat buffer of `state_bytes` (pinned on CUDA; a file on CPU)."""
    import torch

    if device_name.startswith("cuda"):
        device = torch.device(device_name)
        on_device = torch.empty(state_bytes, dtype=torch.uint8, device=device)
        host = torch.empty(state_bytes, dtype=torch.uint8, pin_memory=True)
        down, up = [], []
        for _ in range(repeats):
            torch.cuda.synchronize(device)
            started = time.perf_counter()
            host.copy_(on_device, non_blocking=True)
            torch.cuda.synchronize(device)
            down.append(time.perf_counter() - started)
            started = time.perf_counter()
            on_device.copy_(host, non_blocking=True)
            torch.cuda.synchronize(device)
            up.append(time.perf_counter() - started)
        return state_bytes / min(down) / 1e9, state_bytes / min(up) / 1e9
    from safetensors.torch import load_file, save_file

    with tempfile.TemporaryDirectory() as scratch:
        path = str(Path(scratch) / "floor.safetensors")
        tensor = torch.zeros(state_bytes, dtype=torch.uint8)
        started = time.perf_counter()
        save_file({"state": tensor}, path)
        down = time.perf_counter() - started
        started = time.perf_counter()
        load_file(path)
        up = time.perf_counter() - started
    return state_bytes / down / 1e9, state_bytes / up / 1e9


def main() -> None:
    import torch

    from bench.shapes_parts import build_model
    from tests.support.train_samples import synthetic_samples
    from workers import protocol
    from workers.train_rank.trainer import Trainer

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--intermediate", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=32_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--target", type=float, default=0.5)
    options = parser.parse_args()
    torch.set_num_threads(2)
    device = torch.device(options.device)
    with tempfile.TemporaryDirectory() as work:
        model_dir = build_model(Path(work) / "model", hidden=options.hidden, layers=options.layers,
                                intermediate=options.intermediate, heads=max(1, options.hidden // 64),
                                kv_heads=max(1, options.hidden // 128), vocab_size=options.vocab)
        trainer = Trainer(rank=0, world_size=1, device=device)
        info = trainer.init(init_command({"model_path": str(model_dir), "lr": 1e-5,
                                                  "data_parallel": "replicate", "offload_dir": work}))
        samples = synthetic_samples(model_dir, 4, seed=0)
        trainer.train(protocol.TrainCommand(0, [samples], [sum(len(s.loss_mask) for s in samples)]))
        offloads, onloads, same = [], [], True
        state_bytes = 0
        for _ in range(options.repeats):
            out = trainer.offload(protocol.OffloadCommand(verify=True))
            back = trainer.onload(protocol.OnloadCommand(verify=True))
            same = same and out.digest == back.digest
            state_bytes = out.state_bytes
            offloads.append(out.seconds)
            onloads.append(back.seconds)
    down_floor, up_floor = floor_gbps(state_bytes, options.device, options.repeats)
    down, up = state_bytes / statistics.median(offloads) / 1e9, state_bytes / statistics.median(onloads) / 1e9
    print(f"rank state: {info.num_parameters / 1e6:.1f} M parameters, {state_bytes / 2**30:.2f} GiB "
          f"(parameters, gradients, AdamW) on {options.device}; medians of {options.repeats}")
    print(f"offload {statistics.median(offloads):.3f} s = {down:.2f} GB/s vs floor {down_floor:.2f} GB/s "
          f"({down / down_floor:.2f}×); onload {statistics.median(onloads):.3f} s = {up:.2f} GB/s vs floor "
          f"{up_floor:.2f} GB/s ({up / up_floor:.2f}×); bit-identical after every onload: {same}")
    cuda = options.device.startswith("cuda")
    ok = same and (not cuda or (down >= options.target * down_floor and up >= options.target * up_floor))
    print(("PASS" if ok else "FAIL") + ("" if cuda else " (CPU: a spill file, no bandwidth target)"))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
