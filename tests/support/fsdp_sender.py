"""FSDP_SENDER: the trainer's FSDP2 send path on CPU, one torchrun rank per process, for tests.

    torchrun --nproc-per-node 2 -m tests.support.fsdp_sender MODEL_DIR    (then one JSON command a line on stdin)

Every rank loads the model, moves its weights by `perturb` (the same on every rank) and shards it with the
trainer's own `shard_model` (FSDP2; gloo on CPU here, NCCL on GPU in a run), once. Then, per command that rank 0
reads from stdin and hands to every rank (as bytes over the ranks' own gloo group): `{"op": "broadcast", ...}`
calls the trainer's `weight_buckets.broadcast_weights` with `collective=True` (every rank gathers each bucket,
rank 0 sends it), then a barrier (every rank came out of the send loop: none is left inside a collective);
`{"op": "destroy", "group_name": ...}` ends rank 0's weight group. Rank 0 answers each command with one JSON
line on stdout; end of stdin ends every rank. The ranks are the trainer's code; only the command loop around
them is the test's. One launch serves every update of a test: a torchrun and its ranks cost seconds of CPU each.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import torch


def perturb(model: Any) -> None:
    """The weights the engines must end up with: the model's plus a fixed pseudo-random step."""
    generator = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.1 * torch.randn(param.shape, generator=generator))


def next_command(rank: int) -> dict[str, Any] | None:
    """Rank 0's next stdin line, on every rank (None at end of input)."""
    import torch.distributed as dist

    line = sys.stdin.readline().strip().encode() if rank == 0 else b""
    size = torch.tensor([len(line)], dtype=torch.int64)
    dist.broadcast(size, src=0)
    if size.item() == 0:
        return None
    payload = torch.frombuffer(bytearray(line), dtype=torch.uint8) if rank == 0 else \
        torch.empty(int(size.item()), dtype=torch.uint8)
    dist.broadcast(payload, src=0)
    return json.loads(bytes(payload.tolist()).decode())


def main() -> None:
    import torch.distributed as dist

    from workers.train_rank.model import load_causal_lm
    from workers.train_rank.parallel import shard_model
    from workers.train_rank.weight_buckets import WeightSender, broadcast_weights

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        rank = dist.get_rank()
        model = load_causal_lm(sys.argv[1], dtype=torch.float32, device=torch.device("cpu"))
        perturb(model)
        shard_model(model, device=torch.device("cpu"), compute_dtype=None)
        sender = WeightSender()
        while (command := next_command(rank)) is not None:
            if command["op"] == "destroy":
                answer: dict[str, Any] = {"destroyed": sender.destroy(command["group_name"]) if rank == 0 else False}
            else:
                answer = broadcast_weights(
                    model, sender, rank=rank, train_device=torch.device("cpu"), collective=True,
                    master_address="127.0.0.1", master_port=command["master_port"],
                    world_size=command["world_size"], group_name=command["group_name"], backend="gloo",
                    timeout_s=command["timeout_s"], bucket_bytes=command["bucket_bytes"],
                    load_format=command["load_format"],
                ).to_wire()
                dist.barrier()
            if rank == 0:
                print(json.dumps(answer), flush=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # As the real rank ends (workers/train_rank/__main__.py): without the interpreter's teardown. A weight group
    # that failed to form leaves gloo threads whose teardown can abort the process (SIGABRT, "terminate called
    # without an active exception"), which the test would read as a rank that did not end cleanly.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
