"""Packs a rank's samples into micro-batches (by token budget, or by count) and recomputes response logprobs.

Invariant: logprobs come from `log_softmax(logits[:, :-1])` gathered at the next token, in float32 —
the same quantity an engine reports at temperature 1 — and every per-token tensor is aligned to that
shifted index: position t scores token t + 1, so sample i's response occupies shifted positions
`prompt_length - 1 .. len(tokens) - 2`. Right padding keeps real positions 0..n-1 under a causal mask.

Multi-turn samples: a tool's tokens are response tokens with loss mask 0. Their recorded rollout logprob (slime
writes 0.0; anything a hook wrote) is replaced by 0.0 here, so no value there can reach the loss or its
gradient (a NaN times a zero mask would still be NaN); every loss term and metric is then multiplied by the
mask, so those tokens count nowhere — not in the loss, the KL, the entropy, nor the logprob comparison.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from workers.protocol import WireSample


class BatchError(ValueError):
    """A sample on the wire is malformed (lengths disagree, empty prompt)."""


@dataclass
class MicroBatch:
    input_ids: torch.Tensor  # [B, L] right-padded
    attention_mask: torch.Tensor  # [B, L]
    loss_mask: torch.Tensor  # [B, L-1] float: 1 on trained response tokens
    rollout_log_probs: torch.Tensor  # [B, L-1]
    advantages: torch.Tensor  # [B, L-1]
    num_tokens: int  # non-pad tokens
    #: Each row's response as shifted positions [start, end) (a TIS hook gets per-sample slices).
    spans: tuple[tuple[int, int], ...] = ()
    #: Each row's prompt + response length.
    total_lengths: tuple[int, ...] = ()

    def to(self, device: torch.device) -> MicroBatch:
        return MicroBatch(
            input_ids=self.input_ids.to(device),
            attention_mask=self.attention_mask.to(device),
            loss_mask=self.loss_mask.to(device),
            rollout_log_probs=self.rollout_log_probs.to(device),
            advantages=self.advantages.to(device),
            num_tokens=self.num_tokens,
            spans=self.spans,
            total_lengths=self.total_lengths,
        )


def check_sample(sample: WireSample, index: int) -> None:
    tokens = sample.tokens
    response_length = sample.response_length
    if not isinstance(tokens, list) or not isinstance(response_length, int):
        raise BatchError(f"sample {index}: needs a 'tokens' list and an int 'response_length'")
    if response_length < 0 or response_length >= len(tokens):
        raise BatchError(
            f"sample {index}: response_length {response_length} must leave at least one prompt token "
            f"of {len(tokens)}"
        )
    for key, values in (("loss_mask", sample.loss_mask), ("rollout_log_probs", sample.rollout_log_probs)):
        if not isinstance(values, list) or len(values) != response_length:
            count = len(values) if isinstance(values, list) else "no"
            raise BatchError(
                f"sample {index}: {key} has {count} entries, response_length is {response_length}"
            )


def plan_micro_batches(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Consecutive groups whose padded size (count × longest) fits the budget; a longer sample goes alone."""
    groups: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for index, length in enumerate(lengths):
        new_longest = max(longest, length)
        if current and new_longest * (len(current) + 1) > max_tokens:
            groups.append(current)
            current, new_longest = [], length
        current.append(index)
        longest = new_longest
    if current:
        groups.append(current)
    return groups


def collate(samples: list[WireSample], pad_token_id: int) -> MicroBatch:
    longest = max(len(sample.tokens) for sample in samples)
    size = len(samples)
    input_ids = torch.full((size, longest), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((size, longest), dtype=torch.long)
    loss_mask = torch.zeros((size, longest - 1), dtype=torch.float32)
    rollout = torch.zeros((size, longest - 1), dtype=torch.float32)
    advantages = torch.zeros((size, longest - 1), dtype=torch.float32)
    num_tokens = 0
    spans: list[tuple[int, int]] = []
    for row, sample in enumerate(samples):
        tokens = sample.tokens
        count = len(tokens)
        response_length = sample.response_length
        input_ids[row, :count] = torch.tensor(tokens, dtype=torch.long)
        attention_mask[row, :count] = 1
        start = count - response_length - 1
        if response_length:
            loss_mask[row, start : count - 1] = torch.tensor(sample.loss_mask, dtype=torch.float32)
            rollout[row, start : count - 1] = torch.tensor(
                [value if mask else 0.0 for value, mask in zip(sample.rollout_log_probs, sample.loss_mask,
                                                               strict=True)], dtype=torch.float32)
            advantages[row, start : count - 1] = float(sample.advantage)
        spans.append((start, count - 1))
        num_tokens += count
    return MicroBatch(input_ids, attention_mask, loss_mask, rollout, advantages, num_tokens, tuple(spans),
                      tuple(len(sample.tokens) for sample in samples))


def make_micro_batches(samples: list[WireSample], *, max_tokens: int, pad_token_id: int,
                       micro_batch_size: int | None = None) -> list[MicroBatch]:
    """Micro-batches of `micro_batch_size` consecutive samples (`--micro-batch-size`), or packed by the
    `max_tokens` budget when it is None (`--use-dynamic-batch-size`, the default)."""
    for index, sample in enumerate(samples):
        check_sample(sample, index)
    if micro_batch_size is not None:
        plan = [list(range(start, min(start + micro_batch_size, len(samples))))
                for start in range(0, len(samples), micro_batch_size)]
    else:
        plan = plan_micro_batches([len(sample.tokens) for sample in samples], max_tokens)
    return [collate([samples[i] for i in group], pad_token_id) for group in plan]


def token_log_probs(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """[B, L, V] logits → [B, L-1] logprob of each next token, in float32."""
    log_probs = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    return log_probs.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)


def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """[B, L, V] logits → [B, L-1] entropy of each next-token distribution."""
    log_probs = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    return -(log_probs.exp() * log_probs).sum(-1)
