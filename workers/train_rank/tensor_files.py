"""Tensors written as a safetensors file: what the weight export, `--save-hf` and the LoRA adapter writer share.

Owns `write_safetensors`. Its own module so that `weight_export` (which merges LoRA) and `lora` (which writes
adapters) both use it without importing each other. Invariant: what is written is a contiguous CPU copy of each
tensor; safetensors itself refuses a dtype it cannot store.
"""

from __future__ import annotations

from pathlib import Path

import torch


def write_safetensors(state: dict[str, torch.Tensor], path: Path, *, metadata: dict[str, str]) -> None:
    """Write `state` as one safetensors file (contiguous CPU copies; the library checks dtypes)."""
    from safetensors.torch import save_file

    save_file({name: tensor.detach().to("cpu").contiguous() for name, tensor in state.items()}, str(path),
              metadata=metadata)
