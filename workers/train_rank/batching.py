"""A rank's samples as micro-batches, and the full-logits logprobs the chunked scorer is checked against.

Two layouts of the same per-token tensors: packed (the trainer's: one row of whole samples back to back,
position ids restarting at 0 per sample, no attention mask, so transformers keeps attention within each sample;
`packing` plans which samples share a row) and padded (`collate`: one sample per row, right-padded; kept as
the reference layout). Invariant: every per-token tensor is aligned to the shifted index — position t scores
token t + 1, the same quantity an engine reports at temperature 1 — so a sample starting at offset o with n
tokens has its response at shifted positions `o + prompt_length - 1 .. o + n - 2`; a position scoring the next
sample's first token (or padding) has loss mask 0. `spans` are those response ranges in the flattened
`[B × (L-1)]` per-token layout, one per sample, whatever the layout.

Multi-turn samples: a tool's tokens are response tokens with loss mask 0. Their recorded rollout logprob (slime
writes 0.0; anything a hook wrote) is replaced by 0.0 here, so no value there can reach the loss or its
gradient (a NaN times a zero mask would still be NaN); every loss term and metric is then multiplied by the
mask, so those tokens count nowhere — not in the loss, the KL, the entropy, nor the logprob comparison.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from workers.protocol import WireSample
from workers.protocol.arrays import Kind, as_numpy


class BatchError(ValueError):
    """A sample on the wire is malformed (lengths disagree, empty prompt)."""


@dataclass
class MicroBatch:
    input_ids: torch.Tensor  # [B, L]: B = 1 packed, or right-padded rows
    attention_mask: torch.Tensor | None  # [B, L] padded; None packed (attention follows position_ids)
    loss_mask: torch.Tensor  # [B, L-1] float: 1 on trained response tokens
    rollout_log_probs: torch.Tensor  # [B, L-1]
    advantages: torch.Tensor  # [B, L-1]
    num_tokens: int  # real (non-pad) tokens
    #: Each sample's response as [start, end) in the flattened [B × (L-1)] per-token layout.
    spans: tuple[tuple[int, int], ...] = ()
    #: Each sample's prompt + response length.
    total_lengths: tuple[int, ...] = ()
    #: [B, L] packed: each sample's positions 0..n-1; None padded (the model's default positions).
    position_ids: torch.Tensor | None = None
    #: [B, L-1] long: the sample each shifted position belongs to (len(spans) for none): gspo's sequence means.
    sample_ids: torch.Tensor | None = None
    #: [B, L-1]: on-policy distillation's teacher logprobs from the samples (`distill.teacher_tensor`), or None.
    teacher_log_probs: torch.Tensor | None = None
    opd_reverse_kl: torch.Tensor | None = None  # miles' top-k OPD's per-token term
    #: [B, L-1]: PPO's values before the rollout's first update and its GAE returns (`train_rank.critic`), or None.
    old_values: torch.Tensor | None = None
    returns: torch.Tensor | None = None
    #: a vision-language batch's `pixel_values` / `image_grid_thw` (`train_rank.vision`; position_ids then
    #: [4, 1, L]), or None
    vision: dict[str, torch.Tensor] | None = None

    @property
    def computed_tokens(self) -> int:
        return int(self.input_ids.numel())

    def response_positions(self) -> torch.Tensor:
        """[B, L-1] bool: the shifted positions inside a response (the only ones whose logprobs are used)."""
        flat = torch.zeros(self.loss_mask.numel(), dtype=torch.bool, device=self.loss_mask.device)
        for start, end in self.spans:
            flat[start:end] = True
        return flat.view(self.loss_mask.shape)

    def to(self, device: torch.device) -> MicroBatch:
        def move(tensor: torch.Tensor | None) -> torch.Tensor | None:
            return None if tensor is None else tensor.to(device)

        return MicroBatch(
            input_ids=self.input_ids.to(device),
            attention_mask=move(self.attention_mask),
            loss_mask=self.loss_mask.to(device),
            rollout_log_probs=self.rollout_log_probs.to(device),
            advantages=self.advantages.to(device),
            num_tokens=self.num_tokens,
            spans=self.spans,
            total_lengths=self.total_lengths,
            position_ids=move(self.position_ids),
            sample_ids=move(self.sample_ids),
            teacher_log_probs=move(self.teacher_log_probs),
            opd_reverse_kl=move(self.opd_reverse_kl),
            old_values=move(self.old_values),
            returns=move(self.returns),
            vision=None if self.vision is None else {key: value.to(device) for key, value in self.vision.items()},
        )


def check_sample(sample: WireSample, index: int) -> None:
    """Lengths agree (the wire checked them already; a sample built in-process is checked here too) and every
    trained token's rollout logprob is finite (vectorised: a NaN there would make the loss NaN)."""
    response_length = sample.response_length
    if not isinstance(response_length, int):
        raise BatchError(f"sample {index}: needs an int 'response_length'")
    if response_length < 0 or response_length >= len(sample.tokens):
        raise BatchError(
            f"sample {index}: response_length {response_length} must leave at least one prompt token "
            f"of {len(sample.tokens)}"
        )
    for key, values in (("loss_mask", sample.loss_mask), ("rollout_log_probs", sample.rollout_log_probs)):
        if len(values) != response_length:
            raise BatchError(
                f"sample {index}: {key} has {len(values)} entries, response_length is {response_length}"
            )
    if response_length:
        logprobs = as_numpy(Kind.FLOATS, sample.rollout_log_probs)
        if np.isfinite(logprobs).all():  # the usual case, checked without selecting the trained tokens
            return
        trained = logprobs[as_numpy(Kind.MASK, sample.loss_mask) != 0]
        if not np.isfinite(trained).all():
            raise BatchError(f"sample {index}: a trained token's rollout logprob is not finite "
                             f"({trained[~np.isfinite(trained)][0]})")


def token_ids(sample: WireSample) -> torch.Tensor:
    """The sample's tokens as a long tensor, from its packed int32 buffer (no per-value work)."""
    return torch.from_numpy(as_numpy(Kind.TOKENS, sample.tokens).astype(np.int64))


def collate(samples: list[WireSample], pad_token_id: int) -> MicroBatch:
    """The padded layout: one sample per row, right-padded to the longest."""
    longest = max(len(sample.tokens) for sample in samples)
    size = len(samples)
    input_ids = torch.full((size, longest), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((size, longest), dtype=torch.long)
    loss_mask = torch.zeros((size, longest - 1), dtype=torch.float32)
    rollout = torch.zeros((size, longest - 1), dtype=torch.float32)
    advantages = torch.zeros((size, longest - 1), dtype=torch.float32)
    sample_ids = torch.arange(size).unsqueeze(1).expand(size, longest - 1).clone()
    num_tokens = 0
    spans: list[tuple[int, int]] = []
    for row, sample in enumerate(samples):
        count = len(sample.tokens)
        input_ids[row, :count] = token_ids(sample)
        attention_mask[row, :count] = 1
        start = count - sample.response_length - 1
        fill_response(sample, loss_mask[row], rollout[row], advantages[row], start)
        sample_ids[row, count - 1:] = size
        spans.append((row * (longest - 1) + start, row * (longest - 1) + count - 1))
        num_tokens += count
    return MicroBatch(input_ids, attention_mask, loss_mask, rollout, advantages, num_tokens, tuple(spans),
                      tuple(len(sample.tokens) for sample in samples), sample_ids=sample_ids)


def fill_response(sample: WireSample, loss_mask: torch.Tensor, rollout: torch.Tensor, advantages: torch.Tensor,
                  start: int) -> None:
    """Write a sample's response into 1-D shifted-position tensors from `start` (its prompt length - 1)."""
    end = start + sample.response_length
    if not sample.response_length:
        return
    mask = as_numpy(Kind.MASK, sample.loss_mask)
    loss_mask[start:end] = torch.from_numpy(mask.astype(np.float32))
    # float64 on the wire, rounded to float32 here as the lists were; 0.0 off the loss mask
    logprobs = np.where(mask != 0, as_numpy(Kind.FLOATS, sample.rollout_log_probs), 0.0)
    rollout[start:end] = torch.from_numpy(logprobs.astype(np.float32))
    advantages[start:end] = float(sample.advantage)


