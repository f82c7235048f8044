"""The GPUs this node shows, found without importing torch.

Owns `GpuInventory` (each visible GPU's position — the `cuda:N` a child process sees — and the name the
coordinator's `CUDA_VISIBLE_DEVICES` gives it) and `detect_gpus`, which asks, in order:

1. `RAYLESS_PLAN_GPU_COUNT=N` — an injected count, for planning tests and `--dry-run` only (a real run
   refuses it: see `placement.build_plan`);
2. the NVIDIA driver, through `nvidia-smi -L` (or `/proc/driver/nvidia/gpus` when nvidia-smi is absent),
   narrowed by `CUDA_VISIBLE_DEVICES` as CUDA narrows it (entries in order, up to the first that names no GPU);
3. `CUDA_VISIBLE_DEVICES` alone when no driver tool answers;
4. `torch.cuda.device_count()`, only when the caller says the plan needs GPUs and nothing above answered.

Invariant: positions are what `--base-gpu-id` means and what `LOCAL_RANK` indexes once a child's
`CUDA_VISIBLE_DEVICES` is set from `ids`; a child's `CUDA_VISIBLE_DEVICES` is always built from `ids`, never
from positions, so a coordinator started under `CUDA_VISIBLE_DEVICES=4,5,6,7` places its children on 4..7.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

PLAN_GPU_COUNT_ENV = "RAYLESS_PLAN_GPU_COUNT"
_PROC_GPUS = Path("/proc/driver/nvidia/gpus")


@dataclass(frozen=True)
class GpuInventory:
    """The GPUs a child process launched from here can see, in `cuda:N` order."""

    #: per visible GPU, the name for a child's CUDA_VISIBLE_DEVICES (an index or a GPU-/MIG- UUID)
    ids: tuple[str, ...]
    #: how they were found, for messages ("nvidia-smi -L", "CUDA_VISIBLE_DEVICES=0,1", ...)
    source: str
    #: from RAYLESS_PLAN_GPU_COUNT: fine for planning and --dry-run, never for launching
    injected: bool = False

    @classmethod
    def of_count(cls, count: int, source: str, *, injected: bool = False) -> GpuInventory:
        return cls(ids=tuple(str(i) for i in range(count)), source=source, injected=injected)

    @property
    def count(self) -> int:
        return len(self.ids)

    def visible_devices(self, positions: tuple[int, ...]) -> str:
        """CUDA_VISIBLE_DEVICES for a child that must see exactly these positions (in this order)."""
        return ",".join(self.ids[p] for p in positions)

    def at_most(self, limit: int | None) -> GpuInventory:
        """The first `limit` GPUs (miles' `--num-gpus-per-node`), as CUDA_VISIBLE_DEVICES would narrow them."""
        if limit is None or limit >= self.count:
            return self
        return GpuInventory(ids=self.ids[:limit], source=f"{self.source}, the first {limit} by --num-gpus-per-node",
                            injected=self.injected)

    def describe(self) -> str:
        shown = "no GPU" if not self.ids else f"{self.count} GPU" + ("s" if self.count > 1 else "")
        return f"{shown} ({self.source})"


def detect_gpus(environ: Mapping[str, str] | None = None, *, probe_torch: bool = False) -> GpuInventory:
    """This node's GPUs; see the module docstring for the order of the sources asked."""
    env = os.environ if environ is None else environ
    injected = env.get(PLAN_GPU_COUNT_ENV)
    if injected is not None:
        try:
            count = int(injected)
        except ValueError:
            count = -1
        if count < 0:
            from coordinator.config.fields import ConfigError

            raise ConfigError(f"{PLAN_GPU_COUNT_ENV}={injected!r}: expected a GPU count (an integer >= 0)")
        return GpuInventory.of_count(count, f"{PLAN_GPU_COUNT_ENV}={count}, injected for planning", injected=True)
    physical, driver_source = _driver_gpus()
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        ids = cuda_visible_ids(visible, physical)
        return GpuInventory(ids=ids, source=f"CUDA_VISIBLE_DEVICES={visible!r}"
                            + (f" of {len(physical)} from {driver_source}" if physical is not None else ""))
    if physical is not None:
        return GpuInventory(ids=tuple(str(i) for i in range(len(physical))), source=driver_source)
    if probe_torch:
        count = _torch_count()
        if count is not None:
            return GpuInventory.of_count(count, "torch.cuda.device_count()")
    return GpuInventory(ids=(), source="no NVIDIA driver found: no nvidia-smi, no /proc/driver/nvidia")


def _driver_gpus() -> tuple[list[str] | None, str]:
    """(UUIDs of the node's GPUs, where from), or (None, "") when no driver tool answers."""
    smi = shutil.which("nvidia-smi")
    if smi is not None:
        try:
            result = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=15, check=False)
        except (OSError, subprocess.TimeoutExpired):
            result = None
        if result is not None and result.returncode == 0:
            lines = [line for line in result.stdout.splitlines() if line.startswith("GPU ")]
            return [_uuid(line) for line in lines], "nvidia-smi -L"
    if _PROC_GPUS.is_dir():
        return [entry.name for entry in sorted(_PROC_GPUS.iterdir())], str(_PROC_GPUS)
    return None, ""


def _uuid(line: str) -> str:
    match = re.search(r"UUID: ([^)\s]+)", line)
    return match.group(1) if match else ""


def cuda_visible_ids(visible: str, physical: list[str] | None) -> tuple[str, ...]:
    """CUDA's reading of CUDA_VISIBLE_DEVICES: entries in order up to the first invalid one."""
    ids: list[str] = []
    for entry in (part.strip() for part in visible.split(",")):
        if not entry:
            break
        if entry.lstrip("-").isdigit():
            index = int(entry)
            if index < 0 or (physical is not None and index >= len(physical)):
                break
        elif (physical is not None and not entry.startswith("MIG-")
              and not any(uuid and uuid.startswith(entry) for uuid in physical)):
            break  # a GPU UUID (or prefix) that names no GPU here; MIG instances are not listed by -L
        ids.append(entry)
    return tuple(ids)


def _torch_count() -> int | None:
    try:
        import torch
    except ImportError:
        return None
    return int(torch.cuda.device_count()) if torch.cuda.is_available() else 0
