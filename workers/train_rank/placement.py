"""The model placed as FSDP2 expects: built with its parameters on the meta device, sharded there, then given
storage on the rank's device and its weights one tensor at a time.

Owns `load_sharded`. Rank 0 alone reads the checkpoint (into host memory, through transformers so its key
conversions apply) and broadcasts it tensor by tensor (`set_model_state_dict` with `broadcast_from_rank0`);
every rank keeps only its shard. Invariants: no device ever holds more than its shard plus one full tensor
being broadcast; buffers (rotary frequencies) are the ones the model's own constructor computed, never the
uninitialised storage of `to_empty`; the result equals `model.load_causal_lm` of the same directory, sharded.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from workers.train_rank import packed_attention
from workers.train_rank.model import load_causal_lm, prepare_for_training


@contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Modules built inside get meta parameters (no storage) and real buffers (computed on the CPU)."""
    register = torch.nn.Module.register_parameter

    def on_meta(module: torch.nn.Module, name: str, param: torch.nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None and param.device.type != "meta":
            module._parameters[name] = torch.nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    torch.nn.Module.register_parameter = on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register  # type: ignore[method-assign]


def load_sharded(path: str, *, dtype: torch.dtype, device: torch.device, shard: Callable[[Any], None],
                 attn_implementation: str | None = None, trainable: bool = True,
                 adapt: Callable[[Any], None] | None = None, adapt_full: Callable[[Any], None] | None = None) -> Any:
    """The causal LM of `path`, sharded by `shard` (e.g. `parallel.shard_model`) before it has any weights.
    `adapt` changes the meta model's structure before sharding (LoRA adapters), `adapt_full` the same on rank
    0's full copy, whose state (adapters included) every rank then receives."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(path)
    except OSError as exc:
        raise FileNotFoundError(f"cannot load a causal LM from {path!r}: {exc}") from exc
    kwargs: dict[str, Any] = {"dtype": dtype, "attn_implementation": packed_attention.resolve(attn_implementation)}
    with _parameters_on_meta():
        model = AutoModelForCausalLM.from_config(config, **kwargs)
        if adapt is not None:
            adapt(model)
    buffers = {name: buffer.detach().clone() for name, buffer in model.named_buffers()}
    shard(model)
    model.to_empty(device=device)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            buffer.copy_(buffers[name].to(buffer.dtype))
    full: dict[str, torch.Tensor] = {}
    if dist.get_rank() == 0:
        copy = load_causal_lm(path, dtype=dtype, device=torch.device("cpu"), attn_implementation=attn_implementation,
                              trainable=False)
        if adapt_full is not None:
            adapt_full(copy)
        full = copy.state_dict()
        del copy
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    del full
    return prepare_for_training(model, trainable=trainable)
