"""Releasing a model's weights for real, and bringing the *current* weights back bit-identical.

Owns `WeightStash`, used by the runner for `/release_memory_occupation` with the `weights` tag.

Releasing replaces every parameter's storage with an empty tensor, so the memory goes back to the allocator
and from there to the system: on CPU the resident set shrinks (glibc keeps freed heap pages unless asked, so
`malloc_trim` is called), on CUDA the caching allocator's blocks are handed back to the driver
(`empty_cache`), where a colocated trainer can take them. What comes back on resume is the weights as they
were at release — including every update since launch — not the launch checkpoint:
- on CUDA, a host copy (pinned when it can be) is taken at release and copied back on resume (SGLang's
  `--enable-weights-cpu-backup`);
- on CPU, where a host copy would free nothing, the weights are written to a private safetensors file in the
  spill directory and read back on resume; the file is deleted once read. safetensors stores the exact bytes
  of each dtype, so the round trip is bit-identical.

Invariant: between `release` and `restore` no parameter holds data (every one is an empty tensor of its dtype
on its device), and the runner refuses forwards and weight loads, so nothing can read or write half-released
weights.
"""

from __future__ import annotations

import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from workers.host_memory import trim_host_heap

log = logging.getLogger("rayless.engine.memory")


def return_freed_memory(device: torch.device) -> None:
    """Hand memory freed by dropped tensors back to the system (not only to the allocator's free lists).

    The released tensors are dropped by reference count (nothing holds them in a cycle), so no garbage
    collection is needed to free them; on a loaded host one costs ~0.3 s of every release (colocation pays it
    each step)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        return
    trim_host_heap()


@dataclass
class _Slot:
    parameter: torch.nn.Parameter
    shape: torch.Size
    host_copy: torch.Tensor | None = None  # CUDA only


class WeightStash:
    """Frees a model's parameters and restores them; see the module docstring."""

    def __init__(self, model: torch.nn.Module, device: torch.device, spill_dir: str | None = None) -> None:
        self.model = model
        self.device = device
        self.spill_dir = spill_dir
        self._slots: dict[str, _Slot] = {}
        self._spill_path: Path | None = None

    @property
    def released(self) -> bool:
        return bool(self._slots)

    def parameter_bytes(self) -> int:
        """Bytes the parameters hold now (0 while released)."""
        return sum(p.numel() * p.element_size() for p in self.model.parameters())

    def release(self) -> int:
        """Free every parameter's storage; returns the bytes freed. Idempotent."""
        if self.released:
            return 0
        # named_parameters() yields a tied parameter once, under its first name.
        named = dict(self.model.named_parameters())
        freed = sum(p.numel() * p.element_size() for p in named.values())
        if self.device.type == "cuda":
            slots = {}
            for name, parameter in named.items():
                host = self._host_buffer(parameter.data)
                host.copy_(parameter.data, non_blocking=True)
                slots[name] = _Slot(parameter, parameter.shape, host)
            torch.cuda.synchronize(self.device)
        else:
            self._spill_path = self._spill({name: p.data for name, p in named.items()})
            slots = {name: _Slot(p, p.shape) for name, p in named.items()}
        for slot in slots.values():
            slot.parameter.data = torch.empty(0, dtype=slot.parameter.dtype, device=self.device)
        self._slots = slots
        return_freed_memory(self.device)
        log.info("released %.1f MiB of weights", freed / 2**20)
        return freed

    def restore(self) -> None:
        """Put the released weights back, bit-identical. Idempotent."""
        if not self.released:
            return
        if self.device.type == "cuda":
            for slot in self._slots.values():
                assert slot.host_copy is not None
                slot.parameter.data = slot.host_copy.to(self.device, non_blocking=True)
            torch.cuda.synchronize(self.device)
        else:
            from safetensors.torch import load_file

            assert self._spill_path is not None
            tensors = load_file(str(self._spill_path))
            for name, slot in self._slots.items():
                slot.parameter.data = tensors.pop(name)
            self._spill_path.unlink(missing_ok=True)
            self._spill_path = None
        self._slots = {}
        log.info("restored %.1f MiB of weights", self.parameter_bytes() / 2**20)

    def discard(self) -> None:
        """Delete a spill file left behind (server shutdown while released)."""
        if self._spill_path is not None:
            self._spill_path.unlink(missing_ok=True)
            self._spill_path = None

    @staticmethod
    def _host_buffer(tensor: torch.Tensor) -> torch.Tensor:
        try:
            return torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        except RuntimeError:  # pinning can fail (locked-memory limits): pageable memory still works
            return torch.empty(tensor.shape, dtype=tensor.dtype)

    def _spill(self, tensors: dict[str, torch.Tensor]) -> Path:
        from safetensors.torch import save_file

        if self.spill_dir is not None:
            os.makedirs(self.spill_dir, exist_ok=True)
        handle, name = tempfile.mkstemp(prefix="rayless-released-weights-", suffix=".safetensors", dir=self.spill_dir)
        os.close(handle)
        path = Path(name)
        try:
            save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))
        except BaseException:
            path.unlink(missing_ok=True)
            raise
        return path
