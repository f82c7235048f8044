"""The policy-gradient loss: PPO-style clipped ratio against the rollout logprobs, optional k3 KL, entropy.

Invariant: every term is a token sum over the loss mask divided by `global_loss_tokens`, the number of
loss tokens of the whole optimizer step across all ranks, so summing the ranks' losses (and gradients)
gives the token mean over the global batch whatever the split into ranks and micro-batches.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LossConfig:
    eps_clip: float
    eps_clip_high: float
    kl_coef: float
    use_kl_loss: bool
    entropy_coef: float


def policy_loss(
    *,
    log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    global_loss_tokens: int,
    config: LossConfig,
    entropy: torch.Tensor,
    ref_log_probs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float], dict[str, float]]:
    """Returns (loss to backward, sums to add over ranks, maxima to max over ranks)."""
    denominator = float(max(global_loss_tokens, 1))
    mask = loss_mask
    log_ratio = log_probs - rollout_log_probs
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - config.eps_clip, 1.0 + config.eps_clip_high)
    per_token = torch.maximum(unclipped, clipped)
    pg_loss = (per_token * mask).sum() / denominator
    loss = pg_loss

    sums: dict[str, float] = {}
    maxima: dict[str, float] = {}
    kl_sum = 0.0
    if ref_log_probs is not None:
        # k3 estimator of KL(policy || reference): exp(r) - r - 1 with r = ref - policy; always >= 0.
        ref_log_ratio = ref_log_probs - log_probs
        kl = torch.exp(ref_log_ratio) - ref_log_ratio - 1.0
        kl_term = (kl * mask).sum() / denominator
        if config.use_kl_loss:
            loss = loss + config.kl_coef * kl_term
        kl_sum = float((kl.detach() * mask).sum())
    entropy_term = (entropy * mask).sum() / denominator
    if config.entropy_coef:
        loss = loss - config.entropy_coef * entropy_term

    with torch.no_grad():
        abs_diff = log_ratio.detach().abs() * mask
        sums["loss"] = float(loss.detach())
        sums["pg_loss"] = float(pg_loss.detach())
        sums["loss_tokens"] = float(mask.sum())
        sums["clipped_tokens"] = float(((clipped > unclipped).float() * mask).sum())
        sums["entropy_sum"] = float((entropy.detach() * mask).sum())
        sums["kl_sum"] = kl_sum
        sums["logprob_abs_diff_sum"] = float(abs_diff.sum())
        maxima["logprob_abs_diff_max"] = float(abs_diff.max()) if abs_diff.numel() else 0.0
    return loss, sums, maxima
