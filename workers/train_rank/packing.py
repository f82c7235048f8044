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
from workers.train_rank.batching import MicroBatch, check_sample


def first_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Indices into bins of at most `capacity` tokens: longest first, each into the first bin it fits."""
    bins: list[list[int]] = []
    loads: list[int] = []
    smallest = min(lengths, default=0)
    open_bins: list[int] = []  # in order, the bins with room for the smallest sample: no other can take one
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        length = lengths[index]
        target = next((b for b in open_bins if loads[b] + length <= capacity), None)
        if target is None:
            bins.append([])
            loads.append(0)
            target = len(bins) - 1
            open_bins.append(target)
        bins[target].append(index)
        loads[target] += length
        if loads[target] + smallest > capacity:
            open_bins.remove(target)
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
    return pack_groups(samples, [range(len(samples))], pad_token_id)[0]


def pack_groups(samples: Sequence[WireSample], groups: Sequence[Sequence[int]], pad_token_id: int
                ) -> list[MicroBatch]:
    """`pack` of each group of indices into `samples` (a plan's micro-batches), built with one concatenation per
    field over every group's samples: each micro-batch's tensors are views of one buffer per field, so a rank's
    step costs a few array operations however many samples it has, not a dozen tensor operations per sample."""
    filled = iter(_pack_filled(samples, [group for group in groups if len(group)]))
    return [next(filled) if len(group) else _empty(pad_token_id) for group in groups]


def _empty(pad_token_id: int) -> MicroBatch:
    """A 2-token row of padding and no loss tokens (a micro-batch every rank must run, with no samples)."""
    zeros = torch.zeros((1, 1), dtype=torch.float32)
    return MicroBatch(torch.full((1, 2), pad_token_id, dtype=torch.long), None, zeros, zeros.clone(),
                      zeros.clone(), 0, (), (), torch.arange(2).unsqueeze(0), torch.zeros((1, 1), dtype=torch.long))


def _pack_filled(samples: Sequence[WireSample], groups: list[Sequence[int]]) -> list[MicroBatch]:
    """The micro-batches of non-empty `groups`. Laid out row after row: a row's tokens and positions are its
    samples' back to back; its shifted per-token fields (length tokens - 1) hold, per sample, prompt - 1 zeros,
    the response, and one zero where the row crosses into the next sample (none after the row's last)."""
    if not groups:
        return []
    order = [samples[index] for group in groups for index in group]
    counts = [len(sample.tokens) for sample in order]
    responses = [sample.response_length for sample in order]
    group_sizes = [len(group) for group in groups]
    trail = np.ones(len(order), dtype=np.int64)
    trail[np.cumsum(group_sizes) - 1] = 0
    lead = np.asarray(counts, dtype=np.int64) - np.asarray(responses, dtype=np.int64) - 1
    total = sum(counts)
    input_ids = torch.empty(total, dtype=torch.long)
    np.concatenate([as_numpy(Kind.TOKENS, sample.tokens) for sample in order], out=input_ids.numpy())
    ramp = np.arange(max(counts), dtype=np.int64)
    position_ids = torch.empty(total, dtype=torch.long)
    np.concatenate([ramp[:count] for count in counts], out=position_ids.numpy())
    shifted = total - len(groups)
    zeros = np.zeros(int(lead.max()) + 1, dtype=np.uint8)
    masks, logprobs = [], []
    for sample, before, after in zip(order, lead.tolist(), trail.tolist(), strict=True):
        masks.append(zeros[:before])
        logprobs.append(zeros[:before])
        if sample.response_length:
            masks.append(as_numpy(Kind.MASK, sample.loss_mask))
            logprobs.append(as_numpy(Kind.FLOATS, sample.rollout_log_probs))
        masks.append(zeros[:after])
        logprobs.append(zeros[:after])
    loss_mask = torch.empty(shifted, dtype=torch.float32)
    np.concatenate(masks, out=loss_mask.numpy())
    # float64 on the wire, rounded to float32 here as the lists were; 0.0 off the loss mask
    rollout = torch.empty(shifted, dtype=torch.float32)
    np.concatenate(logprobs, out=rollout.numpy())
    np.copyto(rollout.numpy(), 0.0, where=loss_mask.numpy() == 0)
    pieces = np.stack([lead, np.asarray(responses, dtype=np.int64), trail], axis=1).reshape(-1)
    values = np.zeros((len(order), 3), dtype=np.float32)
    values[:, 1] = [float(sample.advantage) for sample in order]
    advantages = torch.from_numpy(np.repeat(values.reshape(-1), pieces))
    within = np.concatenate([np.arange(size, dtype=np.int64) for size in group_sizes])
    ids = np.stack([within, np.repeat(np.asarray(group_sizes, dtype=np.int64), group_sizes)], axis=1).reshape(-1)
    lengths = np.stack([np.asarray(counts, dtype=np.int64) - 1, trail], axis=1).reshape(-1)
    sample_ids = torch.from_numpy(np.repeat(ids, lengths))
    row_tokens = []
    at = 0
    for size in group_sizes:
        row_tokens.append(sum(counts[at : at + size]))
        at += size
    rows = [tokens - 1 for tokens in row_tokens]
    fields = zip(input_ids.split(row_tokens), position_ids.split(row_tokens), loss_mask.split(rows),
                 rollout.split(rows), advantages.split(rows), sample_ids.split(rows), strict=True)
    batches = []
    at = 0
    for size, tokens, (ids_row, positions, mask_row, rollout_row, advantages_row, sample_row) in zip(
            group_sizes, row_tokens, fields, strict=True):
        spans = []
        offset = 0
        for count, response in zip(counts[at : at + size], responses[at : at + size], strict=True):
            spans.append((offset + count - response - 1, offset + count - 1))
            offset += count
        batches.append(MicroBatch(ids_row.unsqueeze(0), None, mask_row.unsqueeze(0), rollout_row.unsqueeze(0),
                                  advantages_row.unsqueeze(0), tokens, tuple(spans), tuple(counts[at : at + size]),
                                  positions.unsqueeze(0), sample_row.unsqueeze(0)))
        at += size
    return batches
