"""The policy-gradient loss, slime's: PPO-clipped ratio (per token, or per sequence for gspo), truncated
importance sampling, the KL loss with slime's estimators, and the entropy bonus.

With `log_ratio = logp - old` (old: logprobs the trainer recomputed before the rollout's first step, or the
engine's with `--use-rollout-logprobs`), `pg = max(-A·r, -A·clip(r, 1 - eps, 1 + eps_high))` per token, where
`r = exp(log_ratio)` (ppo) or `exp(masked mean of log_ratio over the sample)` (gspo); with `--eps-clip-c c`
(dual-clip PPO) a token whose advantage is negative takes `min(pg, -c·A)`. `--use-tis` multiplies
`pg` by `clamp(exp(old - rollout), tis_clip_low, tis_clip)` (no gradient through the weight). The KL to the
reference (`approx_kl`, estimator `--kl-loss-type`) is always measured when a reference is loaded and added as
`kl_loss_coef · KL` with `--use-kl-loss`; `--entropy-coef` subtracts `coef · entropy`.

Invariant: every term is a token sum over the loss mask divided by `global_loss_tokens`, the number of loss
tokens of the whole optimizer step across all ranks, so summing the ranks' losses (and gradients) gives the
token mean over the global batch whatever the split into ranks and micro-batches.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from workers.protocol.train_settings import LossSettings


def approx_kl(log_probs: torch.Tensor, ref_log_probs: torch.Tensor, kl_type: str) -> torch.Tensor:
    """Per-token KL(policy ‖ reference) estimate, slime's `compute_approx_kl`: with `x = logp - logp_ref`,
    k1 = x; k2 = x²/2; k3 = exp(-x) - 1 + x (never negative); low_var_kl = k3 clamped to [-10, 10]."""
    log_ratio = log_probs.float() - ref_log_probs.float()
    if kl_type == "k1":
        return log_ratio
    if kl_type == "k2":
        return log_ratio.square() / 2.0
    if kl_type not in ("k3", "low_var_kl"):
        raise ValueError(f"unknown kl_loss_type {kl_type!r}")
    kl = torch.exp(-log_ratio) - 1.0 + log_ratio
    return kl.clamp(-10.0, 10.0) if kl_type == "low_var_kl" else kl


def _sequence_mean(values: torch.Tensor, mask: torch.Tensor, sample_ids: torch.Tensor | None) -> torch.Tensor:
    """[B, T] → [B, T]: at each position, its sample's mean over the sample's masked positions (0 for a sample
    without any). `sample_ids` [B, T] says which sample a position is in (packed rows hold several); None: one
    sample per row."""
    if sample_ids is None:
        mean = (values * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1.0)
        return mean.expand_as(values)
    ids = sample_ids.reshape(-1)
    buckets = int(ids.max()) + 1 if ids.numel() else 1
    sums = torch.zeros(buckets, dtype=values.dtype, device=values.device).index_add(0, ids, (values * mask).reshape(-1))
    counts = torch.zeros(buckets, dtype=mask.dtype, device=mask.device).index_add(0, ids, mask.reshape(-1))
    return (sums / counts.clamp(min=1.0))[ids].view_as(values)


def policy_loss(
    *,
    log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    global_loss_tokens: int,
    config: LossSettings,
    entropy: torch.Tensor,
    old_log_probs: torch.Tensor | None = None,
    ref_log_probs: torch.Tensor | None = None,
    tis_hook: Callable[..., Any] | None = None,
    sample_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float], dict[str, float]]:
    """Returns (loss to backward, sums to add over ranks, maxima to max over ranks).

    `old_log_probs` None: the PPO ratio is taken against `rollout_log_probs` (`--use-rollout-logprobs`).
    `tis_hook`: with `--use-tis`, called in place of the built-in weight with (pg_loss, train_log_probs,
    rollout_log_probs, loss_mask) as keywords; returns the weighted per-token loss, the mask it keeps and its
    metric sums (`workers.train_rank.tis_hook`, which the caller binds to the micro-batch's spans).
    `sample_ids`: which sample each position is in, for gspo's sequence ratio in a packed row.
    """
    denominator = float(max(global_loss_tokens, 1))
    mask = loss_mask
    old = rollout_log_probs if old_log_probs is None else old_log_probs
    log_ratio = log_probs - old
    if config.policy_loss == "gspo":
        log_ratio = _sequence_mean(log_ratio, mask, sample_ids)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - config.eps_clip, 1.0 + config.clip_high)
    per_token = torch.maximum(unclipped, clipped)
    if config.eps_clip_c is not None:  # dual-clip: where A < 0, at most -c·A however large the ratio (slime's)
        per_token = torch.where(advantages < 0, torch.minimum(-advantages * config.eps_clip_c, per_token), per_token)
    sums: dict[str, float] = {}
    if config.use_tis and tis_hook is not None:
        per_token, mask, hook_sums = tis_hook(pg_loss=per_token, train_log_probs=old.detach(),
                                              rollout_log_probs=rollout_log_probs, loss_mask=mask)
        sums.update(hook_sums)
    elif config.use_tis:
        raw_weight = torch.exp(old.detach() - rollout_log_probs)
        weight = raw_weight.clamp(min=config.tis_clip_low, max=config.tis_clip)
        per_token = per_token * weight
        sums["tis_sum"] = float((weight * mask).sum())
        sums["tis_clipped_tokens"] = float(((weight != raw_weight).float() * mask).sum())
    pg_loss = (per_token * mask).sum() / denominator
    loss = pg_loss

    kl_sum = 0.0
    if ref_log_probs is not None:
        kl = approx_kl(log_probs, ref_log_probs, config.kl_loss_type)
        if config.use_kl_loss and config.kl_loss_coef:
            loss = loss + config.kl_loss_coef * (kl * mask).sum() / denominator
        kl_sum = float((kl.detach() * mask).sum())
    if config.entropy_coef:
        loss = loss - config.entropy_coef * (entropy * mask).sum() / denominator

    maxima: dict[str, float] = {}
    with torch.no_grad():
        # How far training's logprobs are from the engine's: the train/inference mismatch, whatever `old` is.
        # Over the original loss tokens (as slime measures the mismatch before a TIS hook's rejections).
        abs_diff = (log_probs.detach() - rollout_log_probs).abs() * loss_mask
        sums["loss"] = float(loss.detach())
        sums["pg_loss"] = float(pg_loss.detach())
        sums["loss_tokens"] = float(loss_mask.sum())
        sums["clipped_tokens"] = float(((clipped > unclipped).float() * mask).sum())
        sums["entropy_sum"] = float((entropy.detach() * mask).sum())
        sums["kl_sum"] = kl_sum
        sums["logprob_abs_diff_sum"] = float(abs_diff.sum())
        maxima["logprob_abs_diff_max"] = float(abs_diff.max()) if abs_diff.numel() else 0.0
    return loss, sums, maxima
