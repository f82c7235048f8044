"""TIS hooks in slime's form (`--custom-tis-function-path`) for the rank tests: slime's own vanilla TIS weight,
written as a hook, and a rejection hook that drops the first sample of every micro-batch."""

from __future__ import annotations

from typing import Any

import torch


def vanilla(args: Any, *, pg_loss: torch.Tensor, train_log_probs: list[torch.Tensor],
            rollout_log_probs: list[torch.Tensor], loss_masks: list[torch.Tensor], **kwargs: Any):
    """slime's `vanilla_tis_function`: pg_loss × clamp(exp(train - rollout), tis_clip_low, tis_clip)."""
    tis = torch.exp(torch.cat(train_log_probs) - torch.cat(rollout_log_probs))
    weights = torch.clamp(tis, min=args.tis_clip_low, max=args.tis_clip)
    return pg_loss * weights, loss_masks, {"tis": tis.detach(), "tis_clipfrac": (weights != tis).float()}


def reject_first(args: Any, *, pg_loss: torch.Tensor, loss_masks: list[torch.Tensor], response_lengths: list[int],
                 **kwargs: Any):
    """Rejection sampling at its bluntest: the first sample's tokens leave the loss."""
    masks = [torch.zeros_like(loss_masks[0]), *loss_masks[1:]]
    return pg_loss, masks, {"rejected": torch.tensor(float(response_lengths[0]))}
