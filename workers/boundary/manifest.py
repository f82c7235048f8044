"""A directory's manifest: every file's size and digest, written last, checked before the directory is used.

Owns `manifest.json` (`write_manifest`, `check_manifest`), the digest (`digest_file`: xxh3-128, streamed), the
durable JSON write (`write_json_durably`) and `CheckpointError`. Shared by what writes such directories — the
ranks' checkpoints and the engines' weight snapshots — and what reads them: the coordinator, the ranks and the
engine (which is why it lives in the boundary layer, below both kinds of worker).

Invariants: a listed name is a plain relative path inside the directory, and the file a regular one there (a
symlink out is refused); a failure is a `CheckpointError` naming the file and what is wrong; digests stream in
8 MiB blocks, and the manifest itself is read within `MANIFEST_LIMITS`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import msgspec

from workers.boundary.errors import BoundaryError
from workers.boundary.json_input import JsonLimits, decode_json
from workers.errors import RaylessError

MANIFEST = "manifest.json"
MANIFEST_FORMAT = 1
#: a checkpoint of a few hundred shards lists a few hundred entries
MANIFEST_LIMITS = JsonLimits(max_bytes=16 << 20, max_depth=8, max_items=1_000_000)
_BLOCK = 8 << 20


class CheckpointError(RaylessError, RuntimeError):
    """A checkpoint (or one of its files) that cannot be loaded as it is; the message names the file."""

    #: `rayless train`'s status when this ends a run: refused input, as a start-up check's
    exit_status = 2


def digest_file(path: Path) -> str:
    """xxh3-128 of the file's bytes (as fast as reading them: ~9 GB/s from the page cache here, against
    ~0.8 GB/s for blake2b; it catches damage, it does not authenticate)."""
    import xxhash

    hasher = xxhash.xxh3_128()
    with path.open("rb") as handle:
        while block := handle.read(_BLOCK):
            hasher.update(block)
    return hasher.hexdigest()


def _files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST
                  and not p.name.endswith(".tmp"))


def write_manifest(directory: Path) -> None:
    """The last file of a save: every other file's size and digest (atomically written, fsynced)."""
    files = {str(p.relative_to(directory)): {"size": p.stat().st_size, "digest": digest_file(p)}
             for p in _files(directory)}
    write_json_durably(directory / MANIFEST, {"format": MANIFEST_FORMAT, "digest": "xxh3_128", "files": files})


def write_json_durably(path: Path, value: Any) -> None:
    """`value` as JSON at `path`, atomically (a reader sees the old file or the whole new one) and on disk
    before the rename (so a power loss cannot leave a renamed, empty file)."""
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("wb") as handle:
        handle.write(msgspec.json.format(msgspec.json.encode(value), indent=1))
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    fsync_directory(path.parent)


def fsync_directory(directory: Path) -> None:
    """A directory's entries on disk (a rename or a new file in it survives a power loss from now on)."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class FileEntry(msgspec.Struct):
    size: int
    digest: str


class _Manifest(msgspec.Struct):
    format: int
    digest: str
    files: dict[str, FileEntry]


def check_manifest(directory: Path, *, digests: bool = True, links_within: Path | None = None) -> dict[str, FileEntry]:
    """Every file the manifest lists is present (a regular file inside `directory`, or inside `links_within`
    when given: a Hugging Face cache snapshot's files are symlinks to its `blobs/`) with its size and, when
    `digests`, its digest. Returns the listing."""
    path = directory / MANIFEST
    if not path.is_file():
        raise CheckpointError(f"{path}: missing: the save of {directory.name} did not finish (or the checkpoint "
                              "was written before rayless kept manifests)")
    manifest = _read_manifest(path)
    if manifest.format != MANIFEST_FORMAT or manifest.digest != "xxh3_128":
        raise CheckpointError(f"{path}: format {manifest.format} / digest {manifest.digest!r} is not one this "
                              "rayless reads")
    for name, entry in manifest.files.items():
        if any(part in ("", ".", "..") for part in name.split("/")) or name.startswith("/"):
            raise CheckpointError(f"{path}: lists {name!r}, which is not a path inside the checkpoint")
        size = regular_file_size(directory, name, f"listed in {path}", within=links_within)
        if size != entry.size:
            raise CheckpointError(f"{directory / name}: {size} bytes, the manifest says {entry.size} (truncated "
                                  "or rewritten)")
        if digests and digest_file(directory / name) != entry.digest:
            raise CheckpointError(f"{directory / name}: its content does not match the manifest's digest "
                                  "(damaged after the save)")
    return manifest.files


def hub_cache_root(directory: Path) -> Path | None:
    """The repository folder of a Hugging Face cache snapshot (`<repo>/snapshots/<revision>`, whose files are
    symlinks to `<repo>/blobs/`): where a model directory's listed files may point. None for any other."""
    resolved = directory.resolve()
    if resolved.parent.name == "snapshots" and (resolved.parent.parent / "blobs").is_dir():
        return resolved.parent.parent
    return None


def regular_file_size(directory: Path, name: str, where: str, *, within: Path | None = None) -> int:
    """The size of `directory / name`, a regular file that resolves inside `within` (default: `directory`)."""
    path = directory / name
    try:
        inside = path.resolve(strict=True).is_relative_to((within or directory).resolve())
        info = path.stat()
    except (OSError, RuntimeError):
        raise CheckpointError(f"{path}: missing ({where})") from None
    if not inside:
        raise CheckpointError(f"{path}: points outside {within or directory} (a symlink), refused")
    if not path.is_file():
        raise CheckpointError(f"{path}: not a regular file ({where})")
    return info.st_size


def _read_manifest(path: Path) -> _Manifest:
    try:
        with path.open("rb") as handle:
            raw = handle.read(MANIFEST_LIMITS.max_bytes + 1)
    except OSError as error:
        raise CheckpointError(f"{path}: cannot be read ({error.strerror or error})") from None
    if len(raw) > MANIFEST_LIMITS.max_bytes:
        raise CheckpointError(f"{path}: larger than the {MANIFEST_LIMITS.max_bytes >> 20} MiB a manifest may be")
    try:
        return msgspec.convert(decode_json(raw, str(path), MANIFEST_LIMITS), _Manifest)
    except BoundaryError as error:
        raise CheckpointError(str(error)) from None
    except msgspec.ValidationError as error:
        raise CheckpointError(f"{path}: {error}") from None
