"""Where weight snapshots for the engines are written: a tmpfs directory in colocation, the run directory else.

Owns `snapshot_place`, decided once at start-up (the plan carries it; `--dry-run` prints it) and
`remove_tmpfs_snapshots`, the run's clean-up of it. In colocation the weight update is a disk sync by default
(NCCL cannot join two processes on the same GPU): rank 0 writes a safetensors snapshot and the engines read
it. Through `/dev/shm` (RAM-backed) that costs memory bandwidth, not disk bandwidth. It is chosen when the
directory exists, is writable and has room for the snapshots kept (`--keep-weight-snapshots`) plus the one
being written; otherwise the run directory, and the plan says why.

The snapshot's size is read from the safetensors headers of `--hf-checkpoint` (parameters × 4 bytes: the
ranks train in float32, so that is what a snapshot holds), without torch.

Invariants: a tmpfs directory is private to one run (`rayless-<uid>-<hash of the run directory>`) and is
removed when the run ends, however it ends (RAM, unlike a run directory, is not meant to keep files); nothing
here writes during planning, so a dry run leaves no trace.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path

TMPFS = Path("/dev/shm")
_PREFIX = "rayless-"
#: bytes of one element per safetensors dtype
_ELEMENT_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
                  "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}
#: what a snapshot stores per parameter: the ranks' float32
_SNAPSHOT_ELEMENT_BYTES = 4


@dataclass(frozen=True)
class SnapshotPlace:
    """The snapshot directory of a run and why it is there."""

    directory: Path
    #: a private directory under /dev/shm, removed at the end of the run
    tmpfs: bool
    why: str


def snapshot_place(*, run_dir: Path, model_path: str | None, keep: int, colocated: bool,
                   tmpfs: Path = TMPFS, nodes: int = 1) -> SnapshotPlace:
    """`<run_dir>/weights`, or in colocation on one node a private directory under `tmpfs` when it holds
    `keep + 1` snapshots of the model. On several nodes the engines of every node read rank 0's snapshot, and
    tmpfs is private to its machine, so the (shared) run directory is used."""
    in_run_dir = run_dir / "weights"
    if not colocated:
        return SnapshotPlace(in_run_dir, False, "the run directory")
    if nodes > 1:
        return SnapshotPlace(in_run_dir, False, f"the run directory: {nodes} nodes read rank 0's snapshot, and "
                             f"{tmpfs} is private to one machine")
    if not (tmpfs.is_dir() and os.access(tmpfs, os.W_OK | os.X_OK)):
        return SnapshotPlace(in_run_dir, False, f"the run directory ({tmpfs} is absent or not writable here)")
    size = snapshot_bytes(model_path) if model_path else None
    if size is None:
        return SnapshotPlace(in_run_dir, False, f"the run directory (the snapshot's size is unknown: no "
                             f"safetensors header readable under --hf-checkpoint, so {tmpfs} is not relied on)")
    needed = (keep + 1) * size
    free = shutil.disk_usage(tmpfs).free
    if free < needed:
        return SnapshotPlace(in_run_dir, False, f"the run directory ({tmpfs} has {_gib(free)} free, less than "
                             f"the {_gib(needed)} of {keep + 1} snapshots of {_gib(size)})")
    return SnapshotPlace(tmpfs / _private_name(run_dir) / "weights", True,
                         f"{tmpfs}, {_memory_backed(tmpfs)} ({_gib(free)} free ≥ {keep + 1} snapshots × "
                         f"{_gib(size)}); removed when the run ends")


def remove_tmpfs_snapshots(place: SnapshotPlace) -> None:
    """Delete the run's private tmpfs directory (its snapshots live in RAM). No-op for the run directory."""
    if place.tmpfs and place.directory.parent.name.startswith(_PREFIX):
        shutil.rmtree(place.directory.parent, ignore_errors=True)


def snapshot_bytes(model_path: str) -> int | None:
    """Bytes of one float32 snapshot of the checkpoint at `model_path`, from its safetensors headers; None when
    none can be read."""
    files = sorted(Path(model_path).glob("*.safetensors"))
    if not files:
        return None
    parameters = 0
    try:
        for file in files:
            parameters += _parameters_in(file)
    except (OSError, ValueError):
        return None
    return parameters * _SNAPSHOT_ELEMENT_BYTES


def _parameters_in(file: Path) -> int:
    with file.open("rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        if length > 100 * 1024**2:
            raise ValueError(f"{file}: implausible safetensors header of {length} bytes")
        header = json.loads(handle.read(length))
    count = 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        numel = 1
        for size in entry["shape"]:
            numel *= int(size)
        if entry.get("dtype") not in _ELEMENT_BYTES:
            raise ValueError(f"{file}: unknown dtype {entry.get('dtype')!r} of {name}")
        count += numel
    return count


def _private_name(run_dir: Path) -> str:
    digest = hashlib.sha1(str(run_dir.resolve()).encode()).hexdigest()[:12]
    return f"{_PREFIX}{os.getuid()}-{digest}"


def _memory_backed(path: Path) -> str:
    """`tmpfs` when /proc/mounts says so (what makes it memory, not disk)."""
    try:
        for line in Path("/proc/mounts").read_text().splitlines():
            fields = line.split()
            if len(fields) > 2 and fields[1] == str(path):
                return f"{fields[2]} (memory-backed)" if fields[2] in ("tmpfs", "ramfs") else fields[2]
    except OSError:
        pass
    return "memory-backed on Linux"


def _gib(size: int) -> str:
    return f"{size / 1024**3:.2f} GiB" if size >= 1024**3 else f"{size / 1024**2:.1f} MiB"
