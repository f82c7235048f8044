"""Which of a rank's samples share a micro-batch, and the packed micro-batch itself: one row of whole samples
back to back, no padding (transformers' packed path: position ids restart at 0 per sample and, with no
attention mask, attention stays within each sample — a block-diagonal causal mask on sdpa/eager, varlen on
flash_attention_2).

Owns `first_fit_decreasing` (slime's dynamic batch size: bins of at most `--max-tokens-per-gpu` real tokens),
`split_to_count` (a plan stretched to the micro-batch count every rank must run under FSDP2) and `pack`.
Invariants: every sample is in exactly one micro-batch and whole; a bin holds more than one sample only when
their tokens fit the budget (a longer sample goes alone); the plan is a deterministic function of the lengths.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from workers.protocol import WireSample
from workers.protocol.arrays import Kind, as_numpy
from workers.train_rank.batching import MicroBatch, check_sample, fill_response


def first_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Indices into bins of at most `capacity` tokens: longest first, each into the first bin it fits."""
    bins: list[list[int]] = []
    loads: list[int] = []
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        length = lengths[index]
        target = next((b for b, load in enumerate(loads) if load + length <= capacity), None)
        if target is None:
            bins.append([])
            loads.append(0)
            target = len(bins) - 1
        bins[target].append(index)
        loads[target] += length
    return [sorted(group) for group in bins]


def split_to_count(bins: list[list[int]], lengths: Sequence[int], count: int) -> list[list[int]]:
    """`bins` stretched to `count` micro-batches: the heaviest splittable bin is halved (longest-first into two)
    until there are `count`; with fewer samples than `count`, empty bins make up the rest (a forward of no
    loss tokens, so every rank enters the same number of FSDP2 collectives)."""
    bins = [list(group) for group in bins]
    while len(bins) < count:
        splittable = [b for b, group in enumerate(bins) if len(group) > 1]
        if not splittable:
            bins.extend([] for _ in range(count - len(bins)))
            break
        heaviest = max(splittable, key=lambda b: (sum(lengths[i] for i in bins[b]), -b))
        halves: list[list[int]] = [[], []]
        loads = [0, 0]
        for index in sorted(bins[heaviest], key=lambda i: (-lengths[i], i)):
            side = 0 if loads[0] <= loads[1] else 1
            halves[side].append(index)
            loads[side] += lengths[index]
        bins[heaviest] = sorted(halves[0])
        bins.append(sorted(halves[1]))
    return bins


def plan(samples: Sequence[WireSample], *, max_tokens: int, micro_batch_size: int | None) -> list[list[int]]:
    """Groups of consecutive `micro_batch_size` samples (`--micro-batch-size`), else first-fit-decreasing bins
    of `max_tokens` (`--use-dynamic-batch-size`, the default)."""
    for index, sample in enumerate(samples):
        check_sample(sample, index)
    if micro_batch_size is not None:
        return [list(range(start, min(start + micro_batch_size, len(samples))))
                for start in range(0, len(samples), micro_batch_size)]
    return first_fit_decreasing([len(sample.tokens) for sample in samples], max_tokens)


def pack(samples: Sequence[WireSample], pad_token_id: int) -> MicroBatch:
    """One row of the samples back to back; an empty list gives a 2-token row of padding and no loss tokens."""
    if not samples:
        zeros = torch.zeros((1, 1), dtype=torch.float32)
        return MicroBatch(torch.full((1, 2), pad_token_id, dtype=torch.long), None, zeros, zeros.clone(),
                          zeros.clone(), 0, (), (), torch.arange(2).unsqueeze(0), torch.zeros((1, 1), dtype=torch.long))
    total = sum(len(sample.tokens) for sample in samples)
    input_ids = torch.from_numpy(np.concatenate([as_numpy(Kind.TOKENS, sample.tokens) for sample in samples])
                                 .astype(np.int64))
    position_ids = torch.cat([torch.arange(len(sample.tokens)) for sample in samples])
    loss_mask = torch.zeros(total - 1, dtype=torch.float32)
    rollout = torch.zeros(total - 1, dtype=torch.float32)
    advantages = torch.zeros(total - 1, dtype=torch.float32)
    sample_ids = torch.full((total - 1,), len(samples), dtype=torch.long)
    spans = []
    offset = 0
    for index, sample in enumerate(samples):
        count = len(sample.tokens)
        start = offset + count - sample.response_length - 1
        fill_response(sample, loss_mask, rollout, advantages, start)
        sample_ids[offset : offset + count - 1] = index
        spans.append((start, offset + count - 1))
        offset += count
    return MicroBatch(input_ids.unsqueeze(0), None, loss_mask.unsqueeze(0), rollout.unsqueeze(0),
                      advantages.unsqueeze(0), total, tuple(spans), tuple(len(s.tokens) for s in samples),
                      position_ids.unsqueeze(0), sample_ids.unsqueeze(0))
