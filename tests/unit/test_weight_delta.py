"""slime's delta weight format (`workers.shared_torch.weight_delta`): only tensors whose bytes changed are
written, applying a delta to the base gives the new tensors bit for bit in both encodings and every dtype, and a
delta that is damaged, against another base or for another model is refused whole."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from coordinator.weights.sync import DELTA_LOAD_FORMAT
from workers.boundary.manifest import write_manifest
from workers.shared_torch import weight_delta
from workers.shared_torch.weight_delta import DeltaError, apply_delta, write_delta


def weights(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        "a.weight": torch.randn(4, 3, generator=generator),
        "b.weight": torch.randn(5, generator=generator).to(torch.bfloat16),
        "c.bias": torch.randn(2, 2, generator=generator).to(torch.float16),
        "d.steps": torch.arange(3, dtype=torch.int64),
    }


def same_bytes(x: torch.Tensor, y: torch.Tensor) -> bool:
    return x.dtype == y.dtype and x.shape == y.shape and torch.equal(x.view(torch.uint8), y.view(torch.uint8))


@pytest.mark.parametrize("encoding", ["xor", "overwrite"])
def test_a_delta_holds_only_changed_tensors_and_applies_bit_exactly(tmp_path: Path, encoding: str) -> None:
    old = weights(0)
    new = {name: tensor.clone() for name, tensor in old.items()}
    new["a.weight"][1, 2] += 1e-3
    new["b.weight"] = new["b.weight"] * 2
    new["c.bias"][0, 0] = torch.tensor(float("nan"), dtype=torch.float16)  # bytes, not values, are compared
    path, changed = write_delta(new, old, directory=tmp_path, weight_version="7", base_version="6",
                                encoding=encoding)
    assert path == tmp_path / "delta-7"
    assert sorted(changed) == ["a.weight", "b.weight", "c.bias"]
    index = json.loads((path / weight_delta.INDEX_FILE).read_text())
    assert sorted(index["tensors"]) == sorted(changed) and index["total_tensors"] == 4
    assert index["encoding"] == encoding and index["base_version"] == "6"
    applied = apply_delta(path, old, current_version="6")
    assert sorted(applied) == sorted(changed)
    for name in changed:
        assert same_bytes(applied[name], new[name]), name
    assert old["a.weight"][1, 2] != new["a.weight"][1, 2]  # the base was not patched in place


def test_an_unchanged_model_writes_an_empty_delta(tmp_path: Path) -> None:
    old = weights(0)
    path, changed = write_delta({n: t.clone() for n, t in old.items()}, old, directory=tmp_path,
                                weight_version="2", base_version="1", encoding="xor")
    assert changed == [] and apply_delta(path, old, current_version="1") == {}


def test_a_damaged_delta_or_another_base_is_refused(tmp_path: Path) -> None:
    old, new = weights(0), weights(1)
    path, _ = write_delta(new, old, directory=tmp_path, weight_version="2", base_version="1", encoding="xor")
    with pytest.raises(DeltaError, match="applies to weight version '1', this engine holds '0'"):
        apply_delta(path, old, current_version="0")
    with pytest.raises(DeltaError, match="checksum"):  # right version name, other weights: xor gives garbage
        apply_delta(path, weights(5), current_version="1")
    damaged = bytearray((path / weight_delta.DELTA_FILE).read_bytes())
    damaged[-1] ^= 0xFF
    (path / weight_delta.DELTA_FILE).write_bytes(bytes(damaged))
    with pytest.raises(DeltaError, match="refusing the delta"):  # the manifest's file digest
        apply_delta(path, old, current_version="1")
    write_manifest(path)  # a manifest that agrees with the damage: the per-tensor checksum still refuses it
    with pytest.raises(DeltaError, match="checksum"):
        apply_delta(path, old, current_version="1")


def test_a_delta_for_another_model_is_refused(tmp_path: Path) -> None:
    old, new = weights(0), weights(1)
    path, _ = write_delta(new, old, directory=tmp_path, weight_version="2", base_version="1", encoding="overwrite")
    other = dict(old, **{"a.weight": torch.zeros(3, 4)})
    with pytest.raises(DeltaError, match=re.escape("a.weight is float32 [4, 3], the model's is float32 [3, 4]")):
        apply_delta(path, other, current_version="1")
    with pytest.raises(DeltaError, match="names changed"):
        write_delta(dict(new, extra=torch.ones(1)), old, directory=tmp_path, weight_version="3", base_version="2",
                    encoding="xor")
    with pytest.raises(DeltaError, match="--update-weight-delta-encoding 'zstd'"):
        write_delta(new, old, directory=tmp_path, weight_version="3", base_version="2", encoding="zstd")


def test_the_coordinator_names_the_engines_delta_load_format() -> None:
    assert DELTA_LOAD_FORMAT == weight_delta.LOAD_FORMAT
