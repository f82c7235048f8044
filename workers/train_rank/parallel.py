"""Data parallelism for the rank's model: FSDP2 (`fully_shard`) on CUDA, plain replicas + gloo on CPU.

The one place sharding is applied. Invariant: after `reduce_gradients`, every rank holds the SUM over
ranks of the local gradients (each rank's loss is already divided by the global token count, so the sum
is the gradient of the global token mean); replicas therefore stay bit-identical step after step.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


class Replicated:
    """CPU data parallel: every rank holds the full model; gradients are all-reduced in one flat buffer."""

    sharded = False

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


class FullySharded:
    """CUDA: FSDP2 per decoder layer plus the root; reduce-scatter sums (divide factor 1)."""

    sharded = True

    def __init__(self, model: Any, *, compute_dtype: torch.dtype | None) -> None:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
        layers = getattr(getattr(model, "model", None), "layers", None)
        if layers is None:
            raise TypeError(f"{type(model).__name__} has no .model.layers to shard per decoder layer")
        for layer in layers:
            fully_shard(layer, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        for module in model.modules():
            if hasattr(module, "set_gradient_divide_factor"):
                module.set_gradient_divide_factor(1.0)
        self.model = model

    def reduce_gradients(self) -> None:
        # FSDP2 reduce-scatters during backward.
        return


def apply_data_parallel(model: Any, *, device: torch.device, compute_dtype: torch.dtype | None) -> Any:
    if device.type == "cuda":
        return FullySharded(model, compute_dtype=compute_dtype)
    return Replicated(model)
