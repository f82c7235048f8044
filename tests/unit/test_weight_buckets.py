"""The pieces of a distributed weight update that need no process: bucket plans, the flattened-bucket bytes
against SGLang's own `FlattenedTensorBucket` (from the real wheel), group layouts with tensor parallelism, and
the transfer-mode names."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from coordinator.weights.distributed import group_layout
from coordinator.weights.sync import TRANSFER_MODES, WeightSync
from tests.support import sglang_parts
from workers.shared_torch.weight_group import bucket_layout, flatten_bucket
from workers.train_rank.model import load_causal_lm
from workers.train_rank.weight_buckets import bucket_manifest, plan_buckets, weight_tensors

MIXED = [
    ("a.fp32", torch.float32, [3, 5]),
    ("b.bf16", torch.bfloat16, [3]),  # 6 bytes: a following fp32 tensor would start misaligned
    ("c.fp32", torch.float32, [7]),
    ("d.int8", torch.int8, [5]),
    ("e.fp64", torch.float64, [2]),
    ("f.bf16", torch.bfloat16, [4, 4]),
]


def sglang_receive_bucket(names: list[str], dtypes: list[torch.dtype], shapes: list[list[int]]) -> object:
    """SGLang's receive-side bucket: `FlattenedTensorBucket.empty` (0.5.23), else what 0.5.21 and older do
    (the constructor over empty tensors, which refuses a misaligned tensor only when it is viewed)."""
    bucket_cls = sglang_parts.tensor_bucket_module().FlattenedTensorBucket
    if hasattr(bucket_cls, "empty"):
        return bucket_cls.empty(names, dtypes, shapes, "cpu")
    bucket = bucket_cls(named_tensors=[(n, torch.empty(s, dtype=d)) for n, d, s in zip(names, dtypes, shapes, strict=True)])
    bucket.reconstruct_tensors()
    return bucket


def nbytes(entry: tuple[str, torch.dtype, list[int]]) -> int:
    return torch.Size(entry[2]).numel() * entry[1].itemsize


@pytest.mark.parametrize("bucket_bytes", [1, 40, 64, 100, 10_000])
def test_buckets_cover_every_tensor_once_within_the_size_with_itemsizes_never_increasing(bucket_bytes: int) -> None:
    buckets = plan_buckets(MIXED, bucket_bytes)
    assert sorted(i for b in buckets for i in b) == list(range(len(MIXED)))
    for bucket in buckets:
        assert sum(nbytes(MIXED[i]) for i in bucket) <= bucket_bytes or len(bucket) == 1
        sizes = [MIXED[i][1].itemsize for i in bucket]
        assert sizes == sorted(sizes, reverse=True)
        bucket_layout([MIXED[i][0] for i in bucket], [MIXED[i][1] for i in bucket], [MIXED[i][2] for i in bucket])
    # Same itemsize: state-dict order is kept.
    flat = [MIXED[i][0] for b in buckets for i in b]
    assert flat.index("a.fp32") < flat.index("c.fp32") and flat.index("b.bf16") < flat.index("f.bf16")
    with pytest.raises(ValueError, match="bucket_bytes"):
        plan_buckets(MIXED, 0)


def test_flattened_bytes_and_alignment_are_sglangs() -> None:
    bucket_cls = sglang_parts.tensor_bucket_module().FlattenedTensorBucket
    generator = torch.Generator().manual_seed(0)
    tensors = {name: torch.randn(shape, generator=generator).to(dtype) for name, dtype, shape in MIXED}
    for bucket in plan_buckets(MIXED, 64):
        named = [(MIXED[i][0], tensors[MIXED[i][0]]) for i in bucket]
        theirs = bucket_cls(named_tensors=named)
        ours = flatten_bucket([t for _, t in named])
        assert torch.equal(ours, theirs.get_flattened_tensor())
        layout = bucket_layout([n for n, _ in named], [t.dtype for _, t in named], [list(t.shape) for _, t in named])
        assert layout == [(m.start_idx, m.end_idx - m.start_idx) for m in theirs.get_metadata()]
        # SGLang's receiver accepts the bucket and rebuilds every tensor from our bytes.
        empty: Any = sglang_receive_bucket([n for n, _ in named], [t.dtype for _, t in named],
                                           [list(t.shape) for _, t in named])
        empty.get_flattened_tensor().copy_(ours)
        for (name, got), (_, want) in zip(empty.reconstruct_tensors(), named, strict=True):
            assert torch.equal(got, want), name

    # In state-dict order the fp32 tensor after the 6-byte bf16 one is misaligned: both refuse it alike.
    order = MIXED[:3]
    with pytest.raises(ValueError, match=r"Unaligned received tensor c\.fp32: byte offset 66") as ours_error:
        bucket_layout([n for n, _, _ in order], [d for _, d, _ in order], [s for _, _, s in order])
    with pytest.raises((ValueError, RuntimeError)) as sglang_error:
        sglang_receive_bucket([n for n, _, _ in order], [d for _, d, _ in order], [s for _, _, s in order])
    if hasattr(bucket_cls, "empty"):  # 0.5.23 names the tensor and offset, in the same words as ours
        assert str(ours_error.value) == str(sglang_error.value)


def test_the_manifest_is_the_state_dict_without_tied_aliases_and_needs_no_gather(tiny_model_dir: Path) -> None:
    model = load_causal_lm(str(tiny_model_dir), dtype=torch.float32, device=torch.device("cpu"))
    names = [name for name, _ in weight_tensors(model)]
    assert "lm_head.weight" not in names and names[0] == "model.embed_tokens.weight"
    buckets = bucket_manifest(model, 24 * 1024)
    assert sorted(e[0] for b in buckets for e in b) == sorted(names)
    state = model.state_dict()
    for bucket in buckets:
        for name, dtype, shape in bucket:
            assert dtype == "float32" and shape == list(state[name].shape)
        assert sum(state[n].numel() * 4 for n, _, _ in bucket) <= 24 * 1024 or len(bucket) == 1


def test_group_layout_counts_every_tensor_parallel_rank() -> None:
    one_each = group_layout([1, 1])
    assert (one_each.world_size, one_each.rank_offsets) == (3, [1, 2])
    mixed = group_layout([2, 1, 4])
    assert (mixed.world_size, mixed.rank_offsets) == (8, [1, 3, 4])  # engine i: 1 + tp sizes before it
    with pytest.raises(ValueError, match="tp size"):
        group_layout([1, 0])


def test_transfer_modes_take_miles_broadcast_and_p2p_for_distributed(tmp_path: Path) -> None:
    assert TRANSFER_MODES == {"disk": "disk", "distributed": "distributed", "broadcast": "distributed",
                              "p2p": "distributed"}
    kwargs = {"fleet": None, "client": None, "trainer": None, "snapshot_dir": tmp_path}
    assert WeightSync(mode="broadcast", **kwargs).mode == "distributed"  # type: ignore[arg-type]
    assert WeightSync(mode="p2p", **kwargs).mode == "distributed"  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="--update-weight-transfer-mode 'nccl': choose disk, distributed, broadcast"):
        WeightSync(mode="nccl", **kwargs)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="--update-weight-buffer-size"):
        WeightSync(mode="disk", bucket_bytes=0, **kwargs)  # type: ignore[arg-type]
