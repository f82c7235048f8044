"""Packed attention (`workers.train_rank.packed_attention`): a packed row's logprobs and gradients equal each
sample's own unpacked forward, on the grouped and the per-sample path, and the kernel is only ever asked for a
sample's own pairs; which path runs where (the CUDA varlen branch: its selection, and its layout against a
stand-in, since this CPU has no varlen kernel)."""

from __future__ import annotations

import itertools
import random
from pathlib import Path
from typing import Any

import pytest
import torch

from workers import protocol
from workers.shared_torch.token_scores import token_scores
from workers.train_rank import packed_attention
from workers.train_rank.model import load_causal_lm
from workers.train_rank.packed_attention import (
    GROUPED,
    MODE_ENV,
    PACKED_SDPA,
    PER_SAMPLE,
    VARLEN,
    segment_spans,
)
from workers.train_rank.packing import pack

torch.set_num_threads(1)


def _samples(lengths: list[tuple[int, int]], vocab: int) -> list[protocol.WireSample]:
    rng = random.Random(7)
    return [protocol.WireSample(tokens=[rng.randrange(vocab) for _ in range(prompt + response)],
                                response_length=response, loss_mask=[1] * response,
                                rollout_log_probs=[0.0] * response, advantage=rng.gauss(0.0, 1.0))
            for prompt, response in lengths]


def _grads(model: Any) -> dict[str, torch.Tensor]:
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def test_segments_follow_position_id_restarts() -> None:
    assert segment_spans(torch.tensor([[0, 1, 2, 0, 1, 0, 0, 1]]), 1, 8) == [[(0, 3), (3, 5), (5, 6), (6, 8)]]
    assert segment_spans(torch.tensor([[0, 1, 2], [0, 0, 1]]), 2, 3) == [[(0, 3)], [(0, 1), (1, 3)]]


# one-token prompt, a one-token sample's neighbour, long and short: every span edge case in one row (three
# samples of 4 tokens, apart); many equal lengths side by side and one between them; five lengths interleaved
ROWS = {
    "edges": [(1, 3), (9, 14), (3, 1), (20, 25), (2, 2)],
    "many-equal": [(3, 5)] * 6 + [(2, 9)] + [(5, 3)] * 3 + [(1, 1)] * 4,
    "all-equal": [(3, 5), (6, 2), (1, 7), (4, 4)] * 3,
    "mixed": [(2, 4), (6, 10), (2, 4), (1, 30), (7, 9), (4, 2), (10, 6), (3, 3), (12, 20)],
}


@pytest.mark.parametrize("path", [GROUPED, PER_SAMPLE])
@pytest.mark.parametrize("row", ROWS)
def test_packed_row_equals_unpacked_forwards_in_logprobs_and_gradients(
        tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch, path: str, row: str) -> None:
    monkeypatch.setenv(MODE_ENV, path)
    packed_model = load_causal_lm(str(tiny_model_dir), dtype=torch.float32, device=torch.device("cpu"))
    plain_model = load_causal_lm(str(tiny_model_dir), dtype=torch.float32, device=torch.device("cpu"),
                                 attn_implementation="sdpa")
    assert packed_model.config._attn_implementation == PACKED_SDPA
    vocab = packed_model.config.vocab_size
    samples = _samples(ROWS[row], vocab)
    batch = pack(samples, pad_token_id=0)

    calls: list[tuple[int, int, int, bool]] = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def counting(query: torch.Tensor, key: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append((query.shape[0], query.shape[-2], key.shape[-2], kwargs.get("attn_mask") is None))
        return sdpa(query, key, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", counting)
    packed, _ = token_scores(packed_model, input_ids=batch.input_ids, position_ids=batch.position_ids,
                             with_entropy=False, scored=batch.response_positions())
    weights = batch.advantages * batch.loss_mask
    (packed * weights).sum().backward()
    packed_grads = _grads(packed_model)
    layers = packed_model.config.num_hidden_layers
    # per layer one call per sample (per_sample) or per distinct length with that length's samples as its batch
    # (grouped), each over a sample's own tokens, none with a row × row mask
    lengths = batch.total_lengths
    expected = ([(1, n, n, True) for n in lengths] if path == PER_SAMPLE
                else [(lengths.count(n), n, n, True) for n in set(lengths)])
    assert sorted(calls) == sorted(expected * layers)
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", sdpa)

    worst_log_prob = 0.0
    for sample, (start, end), length in zip(samples, batch.spans, batch.total_lengths, strict=True):
        input_ids = torch.tensor([sample.tokens])
        alone, _ = token_scores(plain_model, input_ids=input_ids, with_entropy=False)
        response = alone[0, length - sample.response_length - 1 :]
        assert response.shape[0] == end - start
        worst_log_prob = max(worst_log_prob, float((response - packed[0, start:end]).detach().abs().max()))
        (response * sample.advantage).sum().backward()
    plain_grads = _grads(plain_model)
    assert worst_log_prob <= 1e-5
    assert packed_grads.keys() == plain_grads.keys()
    worst_grad = max(float((packed_grads[name] - plain_grads[name]).abs().max()) for name in packed_grads)
    assert worst_grad <= 1e-5
    assert max(float(g.abs().max()) for g in plain_grads.values()) > 1e-3  # the comparison is of real gradients


def _attend(path: str, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
            position_ids: torch.Tensor) -> torch.Tensor:
    module = torch.nn.Module()
    module.is_causal = True
    module.num_key_value_groups = query.shape[1] // key.shape[1]
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(MODE_ENV, path)
        return packed_attention.packed_sdpa_forward(module, query, key, value, None, position_ids=position_ids)[0]


def test_grouped_equals_per_sample_bit_for_bit_over_several_rows() -> None:
    """Three rows, equal lengths within and across them, apart and side by side, one row of one length: the
    grouped path's output and gradients are the per-sample path's exactly, and each sample's is its own causal
    attention's."""
    rows = [[4, 4, 4, 1, 7, 4], [7, 2, 2, 2, 4, 3, 4], [6, 6, 6, 6]]
    length = sum(rows[0])
    assert sum(rows[1]) == sum(rows[2]) == length
    position_ids = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in rows])
    generator = torch.Generator().manual_seed(3)
    inputs = [torch.randn(3, length, heads, 8, generator=generator).transpose(1, 2) for heads in (4, 2, 2)]
    weights = torch.randn(3, length, 4, 8, generator=generator)
    results = {}
    for path in (GROUPED, PER_SAMPLE):
        query, key, value = (tensor.detach().clone().requires_grad_() for tensor in inputs)
        out = _attend(path, query, key, value, position_ids)
        (out * weights).sum().backward()
        results[path] = [out.detach(), *(tensor.grad for tensor in (query, key, value))]
    for grouped, per_sample in zip(results[GROUPED], results[PER_SAMPLE], strict=True):
        assert torch.equal(grouped, per_sample)
    start = sum(rows[1][:4])  # row 1's fifth sample (4 tokens) against its own causal attention
    query, key, value = (tensor[1:2, :, start : start + 4] for tensor in inputs)
    alone = torch.nn.functional.scaled_dot_product_attention(query, key.repeat_interleave(2, 1),
                                                             value.repeat_interleave(2, 1), is_causal=True)
    assert torch.allclose(results[GROUPED][0][1, start : start + 4], alone.transpose(1, 2)[0], atol=1e-6)


def test_path_choice_varlen_only_where_its_kernel_runs() -> None:
    cuda = {"device_type": "cuda", "dtype": torch.bfloat16, "head_dim": 128, "capability": (9, 0), "dropout": 0.0}
    assert packed_attention.choose_path("auto", **cuda) == VARLEN
    assert packed_attention.choose_path("auto", **{**cuda, "dtype": torch.float16}) == VARLEN
    for change in ({"device_type": "cpu", "capability": None}, {"capability": (7, 5)}, {"dtype": torch.float32},
                   {"head_dim": 100}, {"head_dim": 512}, {"dropout": 0.1}):
        assert packed_attention.choose_path("auto", **{**cuda, **change}) == GROUPED
        with pytest.raises(RuntimeError, match="varlen cannot run here"):
            packed_attention.choose_path(VARLEN, **{**cuda, **change})
    assert packed_attention.choose_path(PER_SAMPLE, **cuda) == PER_SAMPLE
    assert packed_attention.choose_path(GROUPED, **cuda) == GROUPED
    assert packed_attention.choose_path(VARLEN, **cuda) == VARLEN


def test_asking_for_a_path_this_machine_lacks_or_an_unknown_one_is_refused() -> None:
    query = torch.zeros(1, 2, 4, 8)
    position_ids = torch.tensor([[0, 1, 0, 1]])
    with pytest.raises(RuntimeError, match="no varlen kernel on cpu"):
        _attend(VARLEN, query, query, query, position_ids)
    with pytest.raises(ValueError, match=f"{MODE_ENV}='fast'"):
        _attend("fast", query, query, query, position_ids)


def test_varlen_layout_matches_per_sample_against_a_stand_in_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """The varlen branch's glue (token-major layout, cu_seqlens over the flattened rows, GQA, scale, causal
    window) against a stand-in for `varlen_attn`: this CPU has no varlen kernel, so the stand-in computes its
    documented contract with per-sequence sdpa. The kernel itself is checked on a GPU (bench/gpu_check.sh)."""
    from torch.nn.attention import varlen

    seen: list[tuple[list[int], int, tuple[int, int], bool]] = []

    def stand_in(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seq_q: torch.Tensor,
                 cu_seq_k: torch.Tensor, max_q: int, max_k: int, *, scale: float | None = None,
                 window_size: tuple[int, int] = (-1, -1), enable_gqa: bool = False) -> torch.Tensor:
        seen.append((cu_seq_q.tolist(), max_q, window_size, enable_gqa))
        bounds = cu_seq_q.tolist()
        parts = [torch.nn.functional.scaled_dot_product_attention(
            *(tensor[start:end].transpose(0, 1).unsqueeze(0) for tensor in (query, key, value)),
            is_causal=window_size == (-1, 0), scale=scale, enable_gqa=enable_gqa)[0].transpose(0, 1)
            for start, end in itertools.pairwise(bounds)]
        return torch.cat(parts)

    monkeypatch.setattr(varlen, "varlen_attn", stand_in)
    rows = [[3, 5, 1, 3], [6, 6]]
    position_ids = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in rows])
    spans = segment_spans(position_ids, 2, 12)
    generator = torch.Generator().manual_seed(5)
    query, key, value = (torch.randn(2, 12, heads, 8, generator=generator).transpose(1, 2) for heads in (4, 2, 2))
    out = packed_attention._varlen(query, key, value, spans, 0.3)
    assert seen == [([0, 3, 8, 9, 12, 18, 24], 6, (-1, 0), True)]
    reference = packed_attention._per_sample(query, key, value, spans, lambda q, k, v: torch.nn.functional.
                                             scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3,
                                                                          enable_gqa=True).transpose(1, 2))
    assert out.shape == (2, 12, 4, 8)
    assert torch.allclose(out, reference, atol=1e-6)
