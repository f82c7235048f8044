"""The rank's training state off the device between steps, and back for the step bit-identical (colocation).

Owns `StateOffload`: the parameters, their gradients, the optimizer state and the reference model of one rank
(and PPO's critic with its optimizer state), moved out by `offload()` and back by `onload()`. Two ways, chosen by the device the rank trains on:

- CUDA (FSDP2): each module moves with `module.to("cpu", non_blocking=True)` and back with
  `module.to(device, non_blocking=True)` — FSDP2's `_apply` re-points its sharded parameters (the way miles'
  FSDP actor sleeps), and gradients move with their parameters; each optimizer state tensor that lives on the
  device is moved to host memory and back to the same device. A non-blocking device→host copy lands in pinned
  host memory (torch allocates it pinned, from its caching host allocator, so a later offload reuses it), and
  the copy back from pinned memory is a true DMA: every copy is queued, then one synchronize waits for all. Then the caching allocator hands the freed blocks to the driver (`empty_cache`), where the
  engine on the same GPU takes them. Before bringing the state back, the free device memory must hold it plus
  `--train-memory-margin-bytes` (miles' margin), else the step fails with a message naming the flag instead
  of an out-of-memory error halfway through.
- CPU: there is no device to leave. What colocation needs on a CPU is memory for the engines, so the state
  is written to a private safetensors file in `offload_dir` (a real disk, not tmpfs, so the memory is freed,
  not moved), every tensor's storage is replaced by an empty one and glibc's heap is trimmed: the rank's
  resident set drops by the state's bytes. `onload()` reads it back into the same `Parameter` objects.

safetensors keeps each dtype's exact bytes and `.to()` copies exactly, so either way the state comes back
bit-identical; `digest()` (sha256 over every tensor's bytes, in a fixed order) lets a test or bench check it.

Invariants: between `offload()` and `onload()` nothing reads the state (the trainer onloads first, see
`trainer.handle`); both are idempotent; the `Parameter` objects never change, so the optimizer keeps its
references.
"""

from __future__ import annotations

import gc
import hashlib
import os
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from workers.host_memory import resident_bytes, trim_host_heap


class OffloadError(RuntimeError):
    """The state cannot come back: not enough free device memory (names --train-memory-margin-bytes)."""


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (FSDP2), the tensor itself otherwise."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


@dataclass(kw_only=True, eq=False, repr=False)
class StateOffload:
    """Offloads one rank's model, optimizer and reference model; see the module docstring."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    reference: torch.nn.Module | None
    device: torch.device
    critic: torch.nn.Module | None = None
    critic_optimizer: torch.optim.Optimizer | None = None
    offload_dir: str | None = None
    memory_margin_bytes: int = 0
    offloaded: bool = field(default=False, init=False)
    _state_bytes: int = field(default=0, init=False)
    _spill: Path | None = field(default=None, init=False)
    _optimizer_devices: dict[tuple[str, int, str], torch.device] = field(default_factory=dict, init=False)
    _grads: set[str] = field(default_factory=set, init=False)

    # -- what the state is ---------------------------------------------------------------------------

    def _modules(self) -> list[tuple[str, torch.nn.Module]]:
        return ([("model", self.model)] + ([("reference", self.reference)] if self.reference is not None else [])
                + ([("critic", self.critic)] if self.critic is not None else []))

    def _optimizer_tensors(self) -> Iterator[tuple[str, int, str, dict[str, Any]]]:
        """(optimizer name, parameter index, state key, the state dict holding it) of every optimizer state
        tensor."""
        optimizers = [("optimizer", self.optimizer)] + (
            [("critic_optimizer", self.critic_optimizer)] if self.critic_optimizer is not None else [])
        for prefix, optimizer in optimizers:
            params = [p for group in optimizer.param_groups for p in group["params"]]
            for index, param in enumerate(params):
                state = optimizer.state.get(param)
                for key, value in (state or {}).items():
                    if isinstance(value, torch.Tensor):
                        yield prefix, index, key, state

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor of the state, by a stable name (the local shard of a sharded one)."""
        out: dict[str, torch.Tensor] = {}
        for prefix, module in self._modules():
            for name, param in module.named_parameters():
                out[f"{prefix}/{name}"] = _local(param.data)
                if param.grad is not None:
                    out[f"{prefix}.grad/{name}"] = _local(param.grad)
        for prefix, index, key, state in self._optimizer_tensors():
            out[f"{prefix}/{index}/{key}"] = _local(state[key])
        return out

    def digest(self) -> str:
        """sha256 over every state tensor's name, dtype, shape and bytes."""
        hasher = hashlib.sha256()
        for name, tensor in sorted(self.tensors().items()):
            data = tensor.detach().contiguous().cpu()
            hasher.update(f"{name}|{data.dtype}|{tuple(data.shape)}|".encode())
            if data.numel():
                hasher.update(data.reshape(-1).view(torch.uint8).numpy().tobytes())
        return hasher.hexdigest()

    # -- moving it -----------------------------------------------------------------------------------

    def offload(self, *, verify: bool = False) -> dict[str, Any]:
        if self.offloaded:
            return {"seconds": 0.0, "state_bytes": self._state_bytes, **self._memory()}
        digest = self.digest() if verify else None
        before = self._memory()
        previous_peak = self._new_peak_window()
        started = time.perf_counter()
        self._state_bytes = sum(t.numel() * t.element_size() for t in self.tensors().values())
        if self.device.type == "cuda":
            self._to_host()
        else:
            self._spill_to_file()
        self.offloaded = True
        figures = {"seconds": time.perf_counter() - started, "state_bytes": self._state_bytes,
                   **{f"before_{k}": v for k, v in before.items()}, **self._memory(),
                   **self._peaks(previous_peak)}
        return figures | ({"digest": digest} if digest is not None else {})

    def onload(self, *, verify: bool = False) -> dict[str, Any]:
        if not self.offloaded:
            return {"seconds": 0.0, "state_bytes": self._state_bytes, **self._memory()} | (
                {"digest": self.digest()} if verify else {})
        before = self._memory()
        previous_peak = self._new_peak_window()
        started = time.perf_counter()
        if self.device.type == "cuda":
            self._check_room()
            self._to_device()
        else:
            self._read_back()
        self.offloaded = False
        figures = {"seconds": time.perf_counter() - started, "state_bytes": self._state_bytes,
                   **{f"before_{k}": v for k, v in before.items()}, **self._memory(),
                   **self._peaks(previous_peak)}
        return figures | ({"digest": self.digest()} if verify else {})

    def discard(self) -> None:
        """Delete a spill file left behind (the rank exits while offloaded)."""
        if self._spill is not None:
            self._spill.unlink(missing_ok=True)
            self._spill = None

    # -- CUDA: host memory ---------------------------------------------------------------------------

    def _to_host(self) -> None:
        for _, module in self._modules():
            module.to("cpu", non_blocking=True)
        self._optimizer_devices = {}
        for prefix, index, key, state in self._optimizer_tensors():
            value = state[key]
            if value.device.type != "cpu":
                self._optimizer_devices[(prefix, index, key)] = value.device
                state[key] = value.to("cpu", non_blocking=True)
        torch.cuda.synchronize(self.device)  # the copies are done before their device blocks are reused
        gc.collect()
        torch.cuda.empty_cache()

    def _check_room(self) -> None:
        free, _ = torch.cuda.mem_get_info(self.device)
        needed = self._state_bytes + self.memory_margin_bytes
        if free < needed:
            raise OffloadError(
                f"the training state ({self._state_bytes / 2**20:.0f} MiB) and --train-memory-margin-bytes "
                f"{self.memory_margin_bytes} need {needed / 2**20:.0f} MiB free on {self.device}, but "
                f"{free / 2**20:.0f} MiB are: the engines on this GPU hold more than they should while the "
                "ranks train (do they release their memory? --offload-rollout), or lower the margin")

    def _to_device(self) -> None:
        for _, module in self._modules():
            module.to(self.device, non_blocking=True)
        for prefix, index, key, state in self._optimizer_tensors():
            device = self._optimizer_devices.get((prefix, index, key))
            if device is not None:
                state[key] = state[key].to(device, non_blocking=True)
        self._optimizer_devices = {}
        torch.cuda.synchronize(self.device)

    # -- CPU: a file on disk -------------------------------------------------------------------------

    def _spill_to_file(self) -> None:
        from safetensors.torch import save_file

        tensors = {name: tensor.contiguous() for name, tensor in self.tensors().items()}
        if self.offload_dir is not None:
            os.makedirs(self.offload_dir, exist_ok=True)
        handle, name = tempfile.mkstemp(prefix=f"rayless-train-state-{os.getpid()}-", suffix=".safetensors",
                                        dir=self.offload_dir)
        os.close(handle)
        path = Path(name)
        try:
            save_file(tensors, str(path))
        except BaseException:
            path.unlink(missing_ok=True)
            raise
        del tensors
        self._spill = path
        self._grads = set()
        for prefix, module in self._modules():
            for param_name, param in module.named_parameters():
                param.data = torch.empty(0, dtype=param.dtype)
                if param.grad is not None:
                    self._grads.add(f"{prefix}/{param_name}")
                    param.grad = None
        for _, _, key, state in self._optimizer_tensors():
            state[key] = torch.empty(0, dtype=state[key].dtype)
        trim_host_heap()

    def _read_back(self) -> None:
        from safetensors.torch import load_file

        assert self._spill is not None
        tensors = load_file(str(self._spill))
        for prefix, module in self._modules():
            for name, param in module.named_parameters():
                param.data = tensors.pop(f"{prefix}/{name}")
                if f"{prefix}/{name}" in self._grads:
                    param.grad = tensors.pop(f"{prefix}.grad/{name}")
        for prefix, index, key, state in self._optimizer_tensors():
            state[key] = tensors.pop(f"{prefix}/{index}/{key}")
        self._spill.unlink(missing_ok=True)
        self._spill = None

    # -- figures -------------------------------------------------------------------------------------

    def _new_peak_window(self) -> int | None:
        """CUDA: the allocator's peak since the last window began (the phase that just ended: the train step
        before an offload, the rollout before an onload), and a new window starts."""
        if self.device.type != "cuda":
            return None
        peak = torch.cuda.max_memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        return int(peak)

    def _peaks(self, previous: int | None) -> dict[str, int]:
        """The peak of this move and of the phase before it; the window after it starts now."""
        if previous is None:
            return {}
        peak = self._new_peak_window()
        assert peak is not None
        return {"cuda_peak_bytes": peak, "cuda_previous_phase_peak_bytes": previous}

    def _memory(self) -> dict[str, int]:
        """Where memory stands now: the process's RSS, and on CUDA the allocator's and the device's use."""
        figures = {"rss_bytes": resident_bytes()}
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            figures.update(cuda_allocated_bytes=torch.cuda.memory_allocated(self.device),
                           cuda_reserved_bytes=torch.cuda.memory_reserved(self.device),
                           device_used_bytes=total - free)
        return figures
