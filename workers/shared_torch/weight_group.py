"""Weight-update groups as SGLang 0.5.x forms them, and the byte layout of a flattened bucket.

Owns `join_weight_update_group` (SGLang's `init_custom_process_group` steps: a `TCPStore` hosted by group rank
0 — built here, since under torchrun `rendezvous` would host none — then `PrefixStore(group_name, store)`,
torch's process-group helper and `pg_group_ranks`), the receive side (SGLang's
`receive_weights_from_distributed`: per tensor, or one `flattened_bucket`), and `bucket_layout` with its
alignment rule (every tensor starts at a multiple of its itemsize). Why, from SGLang's code: docs/weight-sync.md.

Invariant: tensors travel in the order of `names`, from group rank 0, each received into a buffer of exactly
the announced dtype and shape, so a mismatch is a gloo size error, never mixed-up weights.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

FLATTENED_BUCKET = "flattened_bucket"
BACKENDS = ("gloo", "nccl")


class WeightGroupError(RuntimeError):
    """A weight-update group could not be formed, or a transfer over it failed."""


@dataclass
class WeightUpdateGroup:
    name: str
    rank: int
    world_size: int
    backend: str
    group: dist.ProcessGroup
    #: the flattened-bucket receive buffer, reused from one request to the next (an engine loads a bucket
    #: before it receives the next): fresh pages for every bucket cost more than the copy itself
    receive_buffer: torch.Tensor | None = None

    @property
    def device(self) -> torch.device:
        """Where tensors that travel over this group live: NCCL moves CUDA tensors, gloo CPU ones."""
        return torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu")

    def close(self) -> None:
        """Destroy the group: frees its name for reuse and, on rank 0, stops hosting the store."""
        self.receive_buffer = None
        try:
            dist.destroy_process_group(self.group)
        except (RuntimeError, KeyError, ValueError):
            pass  # an already-broken or already-destroyed group has nothing left to release


def join_weight_update_group(
    *,
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str,
    backend: str = "gloo",
    timeout_s: float = 300.0,
) -> WeightUpdateGroup:
    """Blocks until all `world_size` ranks joined; WeightGroupError when they do not within `timeout_s`.

    Rank 0 hosts the store on `master_address:master_port`; the other ranks connect to it. `timeout_s` also
    bounds every later transfer over the group (as SGLang's group timeout does).
    """
    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world

    if backend not in BACKENDS:
        raise ValueError(f"backend {backend!r}: choose one of {', '.join(BACKENDS)}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside the group of world_size {world_size}")
    if not group_name:
        raise ValueError("the group name cannot be empty")
    if not 0 < int(master_port) < 2**16:
        raise ValueError(f"master_port {master_port} is outside 1-65535")
    timeout = timedelta(seconds=timeout_s)
    try:
        # What torch's tcp:// rendezvous builds for this rank when no torchelastic agent store is in play.
        store = dist.TCPStore(
            master_address, int(master_port), world_size, is_master=(rank == 0), timeout=timeout,
            multi_tenant=True,
        )
        store.set_timeout(timeout)
        prefixed = PrefixStore(group_name, store)
        group, _ = _new_process_group_helper(
            world_size, rank, [], Backend(backend), prefixed, group_name=group_name, backend_options=None,
            timeout=timeout,
        )
    except (RuntimeError, OSError, ValueError) as exc:  # DistStoreError / DistNetworkError are RuntimeErrors
        raise WeightGroupError(
            f"weight-update group {group_name!r} (rank {rank} of {world_size}, store {master_address}:"
            f"{master_port}, {backend}) did not form within {timeout_s:g} s: {_first_line(exc)}"
        ) from exc
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return WeightUpdateGroup(name=group_name, rank=rank, world_size=world_size, backend=backend, group=group)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


def parse_dtype(name: Any) -> torch.dtype:
    """ "bfloat16" / "torch.bfloat16" / torch.bfloat16 → torch.bfloat16; ValueError names the bad value."""
    if isinstance(name, torch.dtype):
        return name
    value = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return value


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def bucket_layout(
    names: Sequence[str], dtypes: Sequence[torch.dtype], shapes: Sequence[Sequence[int]]
) -> list[tuple[int, int]]:
    """(byte offset, byte size) of each tensor in a flattened bucket; ValueError on a misaligned tensor.

    The same layout and checks as SGLang 0.5.23's `FlattenedTensorBucket.empty`.
    """
    layout = []
    offset = 0
    for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
        if any(int(dim) < 0 for dim in shape):
            raise ValueError(f"Negative dimension in received tensor {name}: {list(shape)}")
        if offset % dtype.itemsize:
            raise ValueError(f"Unaligned received tensor {name}: byte offset {offset}, dtype {dtype}")
        size = torch.Size([int(dim) for dim in shape]).numel() * dtype.itemsize
        layout.append((offset, size))
        offset += size
    if not layout:
        raise ValueError("Cannot create empty tensor bucket")
    return layout


def flatten_bucket(
    tensors: Sequence[torch.Tensor], device: torch.device | None = None, out: torch.Tensor | None = None
) -> torch.Tensor:
    """The sender's bucket: every tensor's bytes concatenated, in order, with no padding (one copy), written
    into the front of `out` (a uint8 buffer at least that large) when given."""
    names = [str(index) for index in range(len(tensors))]
    layout = bucket_layout(names, [t.dtype for t in tensors], [t.shape for t in tensors])
    total = layout[-1][0] + layout[-1][1]
    if out is not None:
        flat = out[:total]
    else:
        flat = torch.empty(total, dtype=torch.uint8, device=device or tensors[0].device)
    for tensor, (offset, size) in zip(tensors, layout, strict=True):
        flat[offset : offset + size].copy_(tensor.detach().contiguous().reshape(-1).view(torch.uint8))
    return flat


def send(group: WeightUpdateGroup, tensors: Sequence[torch.Tensor]) -> list[Any]:
    """Rank 0's side of one request: an async broadcast per tensor (a flattened bucket is one tensor).
    Keep the tensors alive until every returned work is waited on."""
    return [dist.broadcast(tensor, src=0, group=group.group, async_op=True) for tensor in tensors]


def receive(
    group: WeightUpdateGroup,
    names: Sequence[str],
    dtypes: Sequence[torch.dtype],
    shapes: Sequence[Sequence[int]],
    *,
    load_format: str | None = None,
    device: torch.device | str = "cpu",
) -> list[tuple[str, torch.Tensor]]:
    """An engine's side of one `/update_weights_from_distributed`: SGLang's receive loop.

    Any `load_format` but "flattened_bucket" receives tensor by tensor, as SGLang does. A flattened bucket's
    tensors are views of `group.receive_buffer`: valid until the next receive on the group.
    """
    if load_format == FLATTENED_BUCKET:
        layout = bucket_layout(names, dtypes, shapes)  # before the broadcast: a bad layout receives nothing
        total = layout[-1][0] + layout[-1][1]
        buffer = group.receive_buffer
        if buffer is None or buffer.numel() < total or buffer.device != torch.device(device):
            buffer = group.receive_buffer = torch.empty(total, dtype=torch.uint8, device=device)
        flat = buffer[:total]
        dist.broadcast(flat, src=0, group=group.group)
        return [
            (name, flat[offset : offset + size].view(dtype).reshape([int(d) for d in shape]))
            for name, dtype, shape, (offset, size) in zip(names, dtypes, shapes, layout, strict=True)
        ]
    received = [
        (name, torch.empty([int(d) for d in shape], dtype=dtype, device=device))
        for name, dtype, shape in zip(names, dtypes, shapes, strict=True)
    ]
    works = [dist.broadcast(tensor, src=0, group=group.group, async_op=True) for _, tensor in received]
    for work in works:
        work.wait()
    return received
