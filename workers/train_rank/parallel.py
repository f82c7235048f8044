"""Data parallelism for the rank's model: FSDP2 (`fully_shard`) on CUDA, plain replicas + gloo on CPU (FSDP2 on
CPU over gloo too, with the `data_parallel: "fsdp"` setting, so the sharded path runs where there is no GPU).

The one place sharding is applied (`shard_model`, called by `placement` on the meta-device model before any
weight exists). Invariants: after `reduce_gradients`, every rank holds the SUM over ranks of the local gradients
(each rank's loss is already divided by the global token count, so the sum is the gradient of the global token
mean); replicas therefore stay bit-identical step after step. Sharded ranks enter the same collectives in every
forward and backward, so they run the same number of micro-batches (`agree_count`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def use_fsdp(setting: str, device: torch.device) -> bool:
    """"auto": FSDP2 on CUDA, replicas on CPU."""
    return setting == "fsdp" or (setting == "auto" and device.type == "cuda")


class Replicated:
    """CPU data parallel: every rank holds the full model; gradients are all-reduced in one flat buffer."""

    sharded = False

    @staticmethod
    def agree_count(count: int) -> int:
        # Replicas meet only in the gradient all-reduce: their micro-batch counts may differ.
        return count

    def __init__(self, model: Any) -> None:
        self.model = model
        # Ranks load the same files, but a broadcast makes equality a fact rather than an assumption.
        if dist.is_initialized() and dist.get_world_size() > 1:
            with torch.no_grad():
                for tensor in list(model.parameters()) + list(model.buffers()):
                    dist.broadcast(tensor.data, src=0)

    def reduce_gradients(self) -> None:
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return
        params = [p for p in self.model.parameters() if p.requires_grad]
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        offset = 0
        for param, grad in zip(params, grads, strict=True):
            count = grad.numel()
            param.grad = flat[offset : offset + count].view_as(grad).clone()
            offset += count


def shard_model(model: Any, *, device: torch.device, compute_dtype: torch.dtype | None) -> None:
    """FSDP2 per decoder layer plus the root, over all ranks; reduce-scatter sums (divide factor 1)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    inner = getattr(model, "model", None)
    # a vision-language model (Qwen2-VL): its language model's layers, and its vision tower's blocks too
    layers = getattr(getattr(inner, "language_model", inner), "layers", None)
    if layers is None:
        raise TypeError(f"{type(model).__name__} has no .model.layers to shard per decoder layer")
    for layer in [*layers, *getattr(getattr(inner, "visual", None), "blocks", [])]:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    for module in model.modules():
        if hasattr(module, "set_gradient_divide_factor"):
            module.set_gradient_divide_factor(1.0)
            # a plain SUM (no NCCL PreMulSum, which gloo lacks): with a factor of 1 there is nothing to scale
            module.set_force_sum_reduction_for_comms(True)


class FullySharded:
    """A model `shard_model` sharded: FSDP2 reduce-scatters the gradients during backward."""

    sharded = True

    def __init__(self, model: Any, device: torch.device) -> None:
        self.model = model
        self.device = device

    def agree_count(self, count: int) -> int:
        """The most micro-batches any rank has: every rank runs that many (FSDP2 gathers in each one)."""
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return count
        value = torch.tensor([count], dtype=torch.long, device=self.device)
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return int(value.item())

    def reduce_gradients(self) -> None:
        # FSDP2 reduce-scatters during backward.
        return
