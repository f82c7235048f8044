"""Rank-side distributed weight transfer: the bucket plan, per-bucket gathering, and rank 0's sends.

Owns which tensors engines get over a weight-update group (the unsharded Hugging Face state dict minus tied
aliases: the set a disk snapshot holds), how they are cut into buckets of at most `bucket_bytes`, and the send
loop: for each bucket, gather it (a collective under FSDP), flatten it when the engines take
`load_format: "flattened_bucket"`, and broadcast it from rank 0 while the next bucket is gathered.

Invariants:
- the plan depends only on parameter metadata and `bucket_bytes`, so every rank computes the same one with no
  collective, and what the coordinator announces per request is exactly what rank 0 sends;
- inside a bucket itemsizes never increase (tensors ordered by itemsize, largest first, then state-dict order),
  so every tensor of a flattened bucket starts at a multiple of its itemsize (SGLang's alignment rule);
- rank 0 holds at most two buckets of gathered weights (one on the wire, the next being gathered), never a
  second full copy of the model;
- under FSDP every rank enters every bucket's gather, and before each bucket all ranks agree (one broadcast
  from rank 0 on the training group) whether to go on, so a failure on rank 0 (engines that never joined, a
  send that failed) ends the loop on every rank together instead of leaving ranks alone in a collective.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from workers import protocol
from workers.shared_torch.weight_group import (
    FLATTENED_BUCKET,
    WeightGroupError,
    WeightUpdateGroup,
    dtype_name,
    flatten_bucket,
    join_weight_update_group,
    send,
)
from workers.train_rank import lora
from workers.train_rank.model import tied_parameter_names

DEFAULT_BUCKET_BYTES = 512 * 1024**2  # slime's --update-weight-buffer-size


def weight_tensors(model: Any) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) of everything an engine loads, in state-dict order; FSDP2 gives sharded DTensors here
    (no gather: their shape and dtype are the full tensor's). With LoRA adapters, an adapted weight is a
    `lora.MergedWeight`, merged when its bucket is gathered."""
    if lora.has_adapters(model):
        return lora.engine_tensors(model)
    tied = tied_parameter_names(model)
    return [(name, tensor) for name, tensor in model.state_dict().items() if name not in tied]


def plan_buckets(entries: Sequence[tuple[str, torch.dtype, Sequence[int]]], bucket_bytes: int) -> list[list[int]]:
    """Indices into `entries`, cut into buckets of at most `bucket_bytes` (a larger tensor goes alone)."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    order = sorted(range(len(entries)), key=lambda index: -entries[index][1].itemsize)  # stable
    buckets: list[list[int]] = []
    current: list[int] = []
    size = 0
    for index in order:
        _, dtype, shape = entries[index]
        nbytes = torch.Size([int(d) for d in shape]).numel() * dtype.itemsize
        if current and size + nbytes > bucket_bytes:
            buckets.append(current)
            current, size = [], 0
        current.append(index)
        size += nbytes
    if current:
        buckets.append(current)
    return buckets


def bucket_manifest(model: Any, bucket_bytes: int) -> list[list[list[Any]]]:
    """Per bucket, the [name, dtype, shape] of each tensor in send order: what each request announces."""
    entries = [(name, tensor.dtype, tuple(tensor.shape)) for name, tensor in weight_tensors(model)]
    return [
        [[entries[i][0], dtype_name(entries[i][1]), list(entries[i][2])] for i in bucket]
        for bucket in plan_buckets(entries, bucket_bytes)
    ]


class WeightSender:
    """Rank 0's weight-update groups, by name, from join until the coordinator destroys them."""

    def __init__(self) -> None:
        self.groups: dict[str, WeightUpdateGroup] = {}

    def join(
        self, *, master_address: str, master_port: int, world_size: int, group_name: str, backend: str,
        timeout_s: float,
    ) -> WeightUpdateGroup:
        self.destroy(group_name)  # a name is one group: a stale one of the same name goes first
        group = join_weight_update_group(
            master_address=master_address, master_port=master_port, rank=0, world_size=world_size,
            group_name=group_name, backend=backend, timeout_s=timeout_s,
        )
        self.groups[group_name] = group
        return group

    def destroy(self, group_name: str) -> bool:
        group = self.groups.pop(group_name, None)
        if group is None:
            return False
        group.close()
        return True


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _agree(ok: bool, collective: bool, device: torch.device) -> bool:
    """Rank 0's `ok` on every rank (one tiny broadcast on the training group when ranks gather together)."""
    if not collective:
        return ok
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=device)
    dist.broadcast(flag, src=0)
    return bool(flag.item())


def _gather(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    # An FSDP2 DTensor gathers its shards (collective); the attribute test spares importing DTensor's module
    # (tens of MiB) where there is none.
    full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor.detach()
    return full.to(device).contiguous()  # no copy for a CPU parameter sent over gloo


def _finish(works: list[Any], device: torch.device) -> str:
    """Wait for rank 0's sends; '' or what went wrong."""
    try:
        for work in works:
            work.wait()
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()  # NCCL's wait only orders streams
    except RuntimeError as exc:
        return f"sending to the engines failed: {str(exc).strip().splitlines()[0] if str(exc).strip() else exc!r}"
    return ""


def broadcast_weights(
    model: Any,
    sender: WeightSender,
    *,
    rank: int,
    train_device: torch.device,
    collective: bool,
    master_address: str,
    master_port: int,
    world_size: int,
    group_name: str,
    backend: str,
    timeout_s: float,
    bucket_bytes: int,
    load_format: str | None,
) -> protocol.BroadcastWeightsReply:
    """Every rank calls this when `collective` (FSDP: the gathers are collective), else rank 0 alone.

    Rank 0 answers its report (`BroadcastWeightsReply`); a failed join or send is reported there, not raised,
    so the training group stays usable. Other ranks answer the record's defaults.
    """
    if rank != 0 and not collective:
        return protocol.BroadcastWeightsReply()
    started = time.perf_counter()
    error, group = "", None
    if rank == 0:
        try:
            group = sender.join(master_address=master_address, master_port=master_port, world_size=world_size,
                                group_name=group_name, backend=backend, timeout_s=timeout_s)
        except WeightGroupError as exc:
            error = str(exc)
    sent_buckets, sent_bytes = 0, 0
    if _agree(not error, collective, train_device):
        tensors = weight_tensors(model)
        plan = plan_buckets([(n, t.dtype, tuple(t.shape)) for n, t in tensors], bucket_bytes)
        device = group.device if group is not None else train_device
        pending: list[Any] = []
        in_flight: list[torch.Tensor] = []  # alive until their sends finish
        # Two flat buffers, reused: one on the wire while the other is filled. Allocated once per sync, they
        # keep the allocator from growing the heap by a bucket per bucket.
        buffers: list[torch.Tensor | None] = [None, None]
        largest = max((sum(_nbytes(tensors[i][1]) for i in bucket) for bucket in plan), default=0)
        for number, bucket in enumerate(plan):
            if not _agree(not error, collective, train_device):
                break
            gathered = [_gather(tensors[index][1], device) for index in bucket]
            if group is None:
                continue  # ranks > 0 only take part in the gather
            if load_format == FLATTENED_BUCKET:
                if buffers[number % 2] is None:
                    buffers[number % 2] = torch.empty(largest, dtype=torch.uint8, device=device)
                payload = [flatten_bucket(gathered, out=buffers[number % 2])]
            else:
                payload = gathered
            del gathered
            error = _finish(pending, device)  # the previous bucket, sent while this one was gathered
            pending, in_flight = [], []
            if error:
                break
            pending, in_flight = send(group, payload), payload
            sent_buckets += 1
            sent_bytes += sum(t.numel() * t.element_size() for t in payload)
        error = error or _finish(pending, device)
        del in_flight, buffers
    if rank != 0:
        return protocol.BroadcastWeightsReply()
    return protocol.BroadcastWeightsReply(ok=not error, joined=group is not None, error=error, buckets=sent_buckets,
                                          bytes=sent_bytes, seconds=time.perf_counter() - started)
