"""The batched sampler the model runner calls every step, on the model's device.

Owns `sample_rows`: picks the next token for every row of a logits matrix, each row with its own temperature,
top-k, top-p, min-p, penalties, logit bias, banned ids and random generator. (Request validation lives in
`sampling_params`; `RequestError`, `SamplingParams` and `parse_sampling_params` are re-exported here.)

Invariants:
- the logprob returned for a sampled token is `log_softmax(raw float32 logits)[token]` — taken before
  penalties, logit_bias, temperature, top-k/top-p/min-p and the `min_new_tokens` ban. This is what SGLang
  returns by default for plain sampling (it only returns post-temperature logprobs behind a non-default server
  flag), and it is what training compares rollout logprobs against; the adjustments shape the sampling
  distribution only.
- a row's draws depend only on its own generator, a CPU `torch.Generator` whatever the device (one uniform
  per row per step, moved to the device), so a request with a `sampling_seed` samples the same tokens
  whatever else is in the batch, and the same draws on CPU and GPU.
- every tensor made here lives on the logits' device.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from workers.engine.sampling_params import RequestError, SamplingParams, parse_sampling_params

__all__ = ["RequestError", "RowResult", "RowSampling", "SamplingParams", "parse_sampling_params", "sample_rows"]


@dataclass
class RowSampling:
    """How to pick the next token of one sequence in one step (built by the scheduler, read by the runner)."""

    temperature: float  # 0.0: greedy
    top_p: float
    top_k: int  # <= 0: no top-k filter
    min_p: float
    generator: torch.Generator  # on the CPU, whatever the model's device
    banned_ids: Sequence[int] = ()
    top_logprobs_num: int = 0
    token_ids: Sequence[int] = ()  # SGLang's token_ids_logprob: ids whose logprob is reported too
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Sequence[tuple[int, float]] = ()
    output_ids: Sequence[int] = ()  # tokens generated so far; read only when a penalty is set

    @property
    def penalized(self) -> bool:
        return (
            self.frequency_penalty != 0.0 or self.presence_penalty != 0.0 or self.repetition_penalty != 1.0
        )


@dataclass
class RowResult:
    token: int
    logprob: float
    top_logprobs: list[tuple[float, int]] = field(default_factory=list)
    token_ids_logprobs: list[tuple[float, int]] = field(default_factory=list)


def _adjusted(logits: torch.Tensor, rows: Sequence[RowSampling]) -> torch.Tensor:
    """The logits the draw is made from: SGLang's order — penalties, then logit bias — then the ban.

    Returns `logits` itself when no row asks for any of it (no copy)."""
    if not any(row.banned_ids or row.logit_bias or row.penalized for row in rows):
        return logits
    device, vocab = logits.device, logits.shape[1]
    out = logits.clone()
    for index, row in enumerate(rows):
        line = out[index]
        if row.penalized and row.output_ids:
            counts = torch.bincount(
                torch.tensor(list(row.output_ids), dtype=torch.long, device=device), minlength=vocab
            ).to(line.dtype)
            seen = counts > 0
            if row.repetition_penalty != 1.0:
                # SGLang's scaling penalty: shrinks positive logits, grows negative ones, of seen tokens.
                penalty = torch.where(seen, row.repetition_penalty, 1.0).to(line.dtype)
                line.copy_(torch.where(line < 0, line * penalty, line / penalty))
            line.sub_(row.frequency_penalty * counts + row.presence_penalty * seen.to(line.dtype))
        if row.logit_bias:
            ids = torch.tensor([token for token, _ in row.logit_bias], dtype=torch.long, device=device)
            bias = torch.tensor([amount for _, amount in row.logit_bias], dtype=line.dtype, device=device)
            line.index_add_(0, ids, bias)
        if row.banned_ids:
            line[torch.tensor(list(row.banned_ids), dtype=torch.long, device=device)] = -math.inf
    return out


def sample_rows(logits: torch.Tensor, rows: Sequence[RowSampling]) -> list[RowResult]:
    """Sample one token per row of `logits` ([N, V], any float dtype, any device). See the module invariants."""
    logits = logits.float()
    device = logits.device
    count, vocab = logits.shape
    logprobs = torch.log_softmax(logits, dim=-1)
    masked = _adjusted(logits, rows)

    tokens = torch.empty(count, dtype=torch.long, device=device)
    greedy = [i for i, row in enumerate(rows) if row.temperature == 0.0]
    sampled = [i for i, row in enumerate(rows) if row.temperature != 0.0]
    if greedy:
        index = torch.tensor(greedy, dtype=torch.long, device=device)
        tokens[index] = masked[index].argmax(dim=-1)
    if sampled:
        sub = [rows[i] for i in sampled]
        index = torch.tensor(sampled, dtype=torch.long, device=device)
        temps = torch.tensor([row.temperature for row in sub], device=device).unsqueeze(1)
        scaled = masked[index] / temps
        if any(row.top_k > 0 or row.top_p < 1.0 or row.min_p > 0.0 for row in sub):
            sorted_logits, order = scaled.sort(dim=-1, descending=True)
            probs = torch.softmax(sorted_logits, dim=-1)
            ranks = torch.arange(vocab, device=device).unsqueeze(0)
            # top_k is validated to [1, 2**30] (or <= 0 for none); clamped to the vocabulary here.
            top_k = torch.tensor(
                [min(row.top_k, vocab) if row.top_k > 0 else vocab for row in sub], device=device
            ).unsqueeze(1)
            top_p = torch.tensor([row.top_p for row in sub], device=device).unsqueeze(1)
            min_p = torch.tensor([row.min_p for row in sub], device=device).unsqueeze(1)
            cumulative = probs.cumsum(dim=-1)
            drop = ranks >= top_k
            drop |= (cumulative - probs) > top_p
            drop |= probs < min_p * probs[:, :1]
            drop[:, 0] = False  # the most likely token always survives the filters
            probs = probs.masked_fill(drop, 0.0)
        else:
            # No filter asked for: sample the full distribution without sorting it.
            order = None
            probs = torch.softmax(scaled, dim=-1)
        cumulative = probs.cumsum(dim=-1)
        # Inverse-CDF sampling with one uniform draw per row from that row's own (CPU) generator.
        uniforms = torch.cat([torch.rand(1, generator=row.generator) for row in sub]).to(device)
        targets = (uniforms * cumulative[:, -1]).unsqueeze(1)
        choice = torch.searchsorted(cumulative, targets, right=True).clamp_(max=vocab - 1)
        # A draw that lands on a zero-probability slot (rounding at the tail) moves back to the last kept one.
        kept_last = (probs > 0).long().cumsum(dim=-1).argmax(dim=-1, keepdim=True)
        choice = torch.minimum(choice, kept_last)
        tokens[index] = (choice if order is None else order.gather(1, choice)).squeeze(1)

    token_logprobs = logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1).tolist()
    token_list = tokens.tolist()
    results = [RowResult(token=t, logprob=lp) for t, lp in zip(token_list, token_logprobs, strict=True)]
    wanted = [i for i, row in enumerate(rows) if row.top_logprobs_num > 0]
    if wanted:
        k = min(vocab, max(rows[i].top_logprobs_num for i in wanted))
        index = torch.tensor(wanted, dtype=torch.long, device=device)
        values, indices = logprobs[index].topk(k, dim=-1)
        values_list, indices_list = values.tolist(), indices.tolist()
        for position, i in enumerate(wanted):
            num = rows[i].top_logprobs_num
            results[i].top_logprobs = list(
                zip(values_list[position][:num], indices_list[position][:num], strict=True)
            )
    for i, row in enumerate(rows):
        if row.token_ids:
            ids = list(row.token_ids)
            results[i].token_ids_logprobs = list(zip(logprobs[i, ids].tolist(), ids, strict=True))
    return results
