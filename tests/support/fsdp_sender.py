"""FSDP_SENDER: the trainer's FSDP2 send path on CPU, one torchrun rank per process, for tests.

    torchrun --nproc-per-node 2 -m tests.support.fsdp_sender '<json settings>'

Every rank loads the model, moves its weights by `perturb` (the same on every rank), shards it with the
trainer's own `shard_model` (FSDP2; gloo on CPU here, NCCL on GPU in a run), then calls the trainer's
`weight_buckets.broadcast_weights` with `collective=True`: every rank gathers each bucket, rank 0 sends it.
Rank 0 prints its report as one JSON line. The ranks are the trainer's code; only the command loop around
them is left out.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import torch


def perturb(model: Any) -> None:
    """The weights the engines must end up with: the model's plus a fixed pseudo-random step."""
    generator = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.1 * torch.randn(param.shape, generator=generator))


def main() -> None:
    import torch.distributed as dist

    from workers.train_rank.model import load_causal_lm
    from workers.train_rank.parallel import shard_model
    from workers.train_rank.weight_buckets import WeightSender, broadcast_weights

    settings = json.loads(sys.argv[1])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        model = load_causal_lm(settings["model_path"], dtype=torch.float32, device=torch.device("cpu"))
        perturb(model)
        shard_model(model, device=torch.device("cpu"), compute_dtype=None)
        report = broadcast_weights(
            model, WeightSender(), rank=dist.get_rank(), train_device=torch.device("cpu"), collective=True,
            master_address="127.0.0.1", master_port=settings["master_port"], world_size=settings["world_size"],
            group_name=settings["group_name"], backend="gloo", timeout_s=settings["timeout_s"],
            bucket_bytes=settings["bucket_bytes"], load_format=settings["load_format"],
        )
        if dist.get_rank() == 0:
            print(json.dumps(report), flush=True)
        dist.barrier()  # every rank came out of the send loop: none is left inside a collective
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
