"""A stand-alone gloo group for broadcasting weights from the trainer's rank 0 to CPU engines.

Both sides call `join_weight_update_group` with the same address, port, world size and group name: the trainer's
rank 0 as group rank 0 (it hosts the TCPStore), engine i as rank `rank_offset`. No default process group is
created or needed, so it sits beside a torchrun world without touching it (measured in ../shared/MEASURED.md).

Invariant: tensors travel in the order of `names`, one broadcast per tensor from group rank 0, each received
into a buffer of exactly the announced dtype and shape — the same order and shapes on both sides, or gloo
reports a size mismatch instead of mixing up weights.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass
class WeightUpdateGroup:
    name: str
    rank: int
    world_size: int
    store: dist.Store
    group: dist.ProcessGroup

    def close(self) -> None:
        shutdown = getattr(self.group, "shutdown", None)
        if callable(shutdown):
            try:
                shutdown()
            except RuntimeError:
                pass  # an already-broken group has nothing left to release


def join_weight_update_group(
    *,
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str,
    timeout_s: float = 300.0,
) -> WeightUpdateGroup:
    """Blocks until all `world_size` ranks joined (or `timeout_s` passed: RuntimeError/DistStoreError)."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside the group of world_size {world_size}")
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(
        master_address,
        int(master_port),
        world_size,
        is_master=(rank == 0),
        timeout=timeout,
        wait_for_workers=False,
    )
    # The prefix lets several groups share one store without their keys colliding.
    prefixed = dist.PrefixStore(f"{group_name}/", store)
    group = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
    return WeightUpdateGroup(name=group_name, rank=rank, world_size=world_size, store=store, group=group)


def parse_dtype(name: str) -> torch.dtype:
    """ "bfloat16" / "torch.bfloat16" → torch.bfloat16; ValueError names the bad string."""
    value = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return value


def _from_rank_0() -> dist.BroadcastOptions:
    # The options form of ProcessGroup.broadcast is the one every torch 2.x accepts.
    options = dist.BroadcastOptions()
    options.rootRank = 0
    options.rootTensor = 0
    return options


def broadcast_tensors(group: WeightUpdateGroup, tensors: Sequence[torch.Tensor]) -> None:
    """Rank 0's side: send each tensor, in order."""
    for tensor in tensors:
        group.group.broadcast([tensor.detach().contiguous().cpu()], _from_rank_0()).wait()


def receive_tensors(
    group: WeightUpdateGroup, dtypes: Sequence[torch.dtype], shapes: Sequence[Sequence[int]]
) -> list[torch.Tensor]:
    """An engine's side: one buffer per announced tensor, filled by rank 0's broadcasts in order."""
    received = []
    for dtype, shape in zip(dtypes, shapes, strict=True):
        buffer = torch.empty(tuple(int(s) for s in shape), dtype=dtype)
        group.group.broadcast([buffer], _from_rank_0()).wait()
        received.append(buffer)
    return received
