"""The torch-free reader of DCP's `.metadata` (`workers.boundary.dcp_metadata`, what the coordinator's checks
read) against what torch.distributed.checkpoint writes, and the one allow-list both readers share.

A real `dcp.save` of tensors of several dtypes and shapes (a scalar, an empty one) and plain values is read into
records equal, field by field, to torch's own classes as the ranks' reader gives them; every allowed name
resolves in the installed torch, whose dtypes and layouts the allow-list lists whole. A planted `os.system`
pickle, a global outside the list (even one of torch's), a persistent id and damaged metadata are refused by
both readers naming `.metadata`, running nothing."""

from __future__ import annotations

import dataclasses
import os
import pickle  # noqa: TID251 - writes the crafted files under test (as DCP's writer does); never loads one
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from workers.boundary import dcp_metadata as records
from workers.train_rank import checkpoint_files as files

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory `dcp.save` wrote (one process): tensors of four dtypes, a scalar, an empty one, plain values."""
    directory = tmp_path_factory.mktemp("dcp")
    state = {"model": {"w": torch.ones(3, 4), "half": torch.zeros(2, dtype=torch.bfloat16),
                       "steps": torch.arange(5), "mask": torch.tensor([True, False]), "scalar": torch.tensor(2.5),
                       "empty": torch.zeros(0, 7)},
             "extra": {"lr": 1e-3, "betas": (0.9, 0.99), "name": "adamw"}}
    dcp.save(state, checkpoint_id=str(directory))
    return directory


def test_the_records_equal_what_torch_reads(written: Path) -> None:
    import sys

    meta = records.read_dcp_metadata(written)
    real = files.read_metadata(written)  # the ranks' reader: torch's own classes
    assert type(real).__module__ == "torch.distributed.checkpoint.metadata" and "torch" in sys.modules
    assert set(meta.state_dict_metadata) == set(real.state_dict_metadata)
    shapes = records.tensors(meta)
    assert set(shapes) == {f"model.{n}" for n in ("w", "half", "steps", "mask", "scalar", "empty")}
    for key, entry in real.state_dict_metadata.items():
        mine = meta.state_dict_metadata[key]
        if key in shapes:
            shape, dtype = shapes[key]
            assert shape == tuple(entry.size) and dtype.name == str(entry.properties.dtype).removeprefix("torch.")
            assert dtype.floating == entry.properties.dtype.is_floating_point
            assert mine.properties.layout.name == str(entry.properties.layout)
            assert [(c.offsets, c.sizes) for c in mine.chunks] == [(tuple(c.offsets), tuple(c.sizes))
                                                                   for c in entry.chunks]
        else:
            assert isinstance(mine, records.BytesStorageMetadata) and type(entry).__name__ == "BytesStorageMetadata"
    stored = {(i.fqn, i.offset): (s.relative_path, s.offset, s.length) for i, s in meta.storage_data.items()}
    assert stored == {(i.fqn, tuple(i.offset) if i.offset is not None else None): (s.relative_path, s.offset, s.length)
                      for i, s in real.storage_data.items()}
    assert meta.version == real.version and str(meta.storage_meta.checkpoint_id) == str(real.storage_meta.checkpoint_id)
    records.check_shards(written, meta)  # every item within its shard, every chunk stored
    assert records.shard_names(meta) == {p.name for p in written.glob("*.distcp")}


def test_one_allow_list_resolves_whole_in_the_installed_torch() -> None:
    """Every name the list allows is an object of this torch (the ranks' reader resolves them), and the list
    names every dtype and layout it has: a torch that adds one fails here, not on a user's checkpoint."""
    from torch.distributed.checkpoint import filesystem, metadata

    dtypes = {str(v).removeprefix("torch."): v.is_floating_point for v in vars(torch).values()
              if isinstance(v, torch.dtype)}
    assert records.DTYPES == dtypes
    assert records.LAYOUTS == {str(v) for v in vars(torch).values() if isinstance(v, torch.layout)}
    resolved = {key: files._torch_global(*key) for key in records.ALLOWED}
    assert resolved[("torch.distributed.checkpoint.metadata", "Metadata")] is metadata.Metadata
    assert resolved[("torch.distributed.checkpoint.filesystem", "_StorageInfo")] is filesystem._StorageInfo
    assert resolved[("torch", "Size")] is torch.Size and resolved[("torch", "bfloat16")] is torch.bfloat16
    assert {m.value for m in metadata._MEM_FORMAT_ENCODING} == records.MEMORY_FORMATS
    dataclass_fields = {cls: {f.name for f in dataclasses.fields(cls)} for cls in (
        metadata.Metadata, metadata.TensorStorageMetadata, metadata.ChunkStorageMetadata, metadata.MetadataIndex,
        metadata.StorageMeta, filesystem._StorageInfo)}
    for cls, names in dataclass_fields.items():  # a field DCP adds is a field the records read
        assert set(records.ALLOWED[(cls.__module__, cls.__name__)]._FIELDS) == names, cls


def _hostile(directory: Path, raw: bytes) -> Path:
    (directory / ".metadata").write_bytes(raw)
    return directory


READERS: dict[str, Callable[[Path], object]] = {"torch-free": records.read_dcp_metadata,
                                                 "ranks'": files.read_metadata}


@pytest.mark.parametrize("reader", sorted(READERS))
def test_a_planted_pickle_runs_nothing_and_is_refused_naming_the_file(reader: str, written: Path,
                                                                        tmp_path: Path) -> None:
    marker = tmp_path / "MARKER"

    class Payload:
        def __reduce__(self) -> tuple[object, ...]:
            return (os.system, (f"touch {marker}",))

    hostile = {
        "os.system": (pickle.dumps(Payload()), "refusing to load posix.system"),
        "a torch function": (b"ctorch\nload\n(S'x'\ntR.", "refusing to load torch.load"),
        "a builtin through a record's module": (
            b"ctorch.distributed.checkpoint.metadata\ngetattr\n.", "refusing to load "
            "torch.distributed.checkpoint.metadata.getattr"),
        "a persistent id": (b"P0\n.", "refusing a persistent id"),
        "the real file cut short": ((written / ".metadata").read_bytes()[:200], "not DCP checkpoint metadata ("),
    }
    for name, (raw, refusal) in hostile.items():
        directory = tmp_path / name.replace(" ", "-").replace(".", "-")
        directory.mkdir()
        with pytest.raises(files.CheckpointError) as refused:
            READERS[reader](_hostile(directory, raw))
        assert str(refused.value).startswith(f"{directory / '.metadata'}: {refusal}"), (name, refused.value)
    assert not marker.exists()


def _damaged(written: Path, change: Callable[[object], object]) -> bytes:
    """The real metadata (torch's classes) changed, pickled as DCP's writer pickles it."""
    meta = files.read_metadata(written)
    return pickle.dumps(change(meta) or meta)


def _set(obj: object, name: str, value: object) -> None:
    object.__setattr__(obj, name, value)


def _negative_offsets(meta: object) -> None:
    for info in meta.storage_data.values():  # type: ignore[attr-defined]  # torch's Metadata
        _set(info, "offset", -1)


DAMAGE: dict[str, tuple[Callable[[object], object], str]] = {
    "a chunk outside its shape": (
        lambda m: _set(m.state_dict_metadata["model.w"].chunks[0], "offsets", torch.Size([1, 0])),
        "a chunk of tensor model.w is malformed or outside its shape [3, 4]"),
    "a negative size": (lambda m: _set(m.state_dict_metadata["model.w"], "size", torch.Size([-3, 4])),
                        "not DCP checkpoint metadata (_Malformed: a torch.Size of something other than"),
    "a string for a size": (lambda m: _set(m.state_dict_metadata["model.w"], "size", "3x4"),
                            "tensor model.w is malformed"),
    "a negative offset in a shard": (_negative_offsets, "the storage of "),
    "a dict, not Metadata": (lambda m: {"state_dict_metadata": {}}, "a dict, not a Metadata"),
    "an entry of another kind": (lambda m: m.state_dict_metadata.__setitem__("model.w", m.storage_meta),
                                 "entry model.w is a StorageMeta"),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_damaged_metadata_is_refused_by_both_readers_naming_it(damage: str, written: Path, tmp_path: Path) -> None:
    change, expected = DAMAGE[damage]
    directory = _hostile(tmp_path, _damaged(written, change))
    for reader in READERS.values():
        with pytest.raises(files.CheckpointError) as refused:
            reader(directory)
        assert str(refused.value).startswith(f"{directory / '.metadata'}: "), refused.value
        assert expected in str(refused.value), refused.value
