"""Packed attention (`workers.train_rank.packed_attention`): a packed row's logprobs and gradients equal each
sample's own unpacked forward, and the kernel is only ever asked for a sample's own pairs."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from workers import protocol
from workers.shared_torch.token_scores import token_scores
from workers.train_rank.model import load_causal_lm
from workers.train_rank.packed_attention import PACKED_SDPA, segment_spans
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


def test_packed_row_equals_unpacked_forwards_in_logprobs_and_gradients(
        tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    packed_model = load_causal_lm(str(tiny_model_dir), dtype=torch.float32, device=torch.device("cpu"))
    plain_model = load_causal_lm(str(tiny_model_dir), dtype=torch.float32, device=torch.device("cpu"),
                                 attn_implementation="sdpa")
    assert packed_model.config._attn_implementation == PACKED_SDPA
    vocab = packed_model.config.vocab_size
    # one-token prompt, a one-token sample's neighbour, long and short: every span edge case in one row
    samples = _samples([(1, 3), (9, 14), (3, 1), (20, 25), (2, 2)], vocab)
    batch = pack(samples, pad_token_id=0)

    calls: list[tuple[int, int, bool]] = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def counting(query: torch.Tensor, key: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append((query.shape[-2], key.shape[-2], kwargs.get("attn_mask") is None))
        return sdpa(query, key, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", counting)
    packed, _ = token_scores(packed_model, input_ids=batch.input_ids, position_ids=batch.position_ids,
                             with_entropy=False, scored=batch.response_positions())
    weights = batch.advantages * batch.loss_mask
    (packed * weights).sum().backward()
    packed_grads = _grads(packed_model)
    layers = packed_model.config.num_hidden_layers
    # per layer one call per sample, each over the sample's own tokens, none with a row × row mask
    assert sorted(calls) == sorted((n, n, True) for n in batch.total_lengths for _ in range(layers))
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
