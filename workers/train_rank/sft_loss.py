"""The SFT loss (slime's `sft_loss`): the negative log-likelihood of the loss-mask tokens, a token mean.

Owns `sft_loss` and `loss_function`, the trainer's one choice between it and the policy loss by the rank
settings' `loss_type`. `sft_loss` is called with the policy loss's keywords (the trainer builds one call for
both) and reads only the logprobs, the mask and the step's token count: `loss = -Σ mask·logp /
global_loss_tokens`, so the ranks' losses (and gradients) add up to the token mean over the whole optimizer
step, as the policy loss's terms do. Its metrics are the policy loss's sums with the policy terms at 0
(`loss` = `pg_loss` = the NLL share, `loss_tokens`, `entropy_sum`), so the coordinator reduces both alike.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from workers.train_rank.loss import policy_loss

LOSS_TYPES = ("policy_loss", "sft_loss")


def sft_loss(*, log_probs: torch.Tensor, loss_mask: torch.Tensor, global_loss_tokens: int,
             entropy: torch.Tensor | None = None, **_policy_inputs: Any
             ) -> tuple[torch.Tensor, dict[str, float], dict[str, float]]:
    """Returns (loss to backward, sums to add over ranks, maxima to max over ranks); `_policy_inputs` (the
    advantages, rollout/old/reference logprobs, ...) have no part in the NLL."""
    mask = loss_mask.to(log_probs.dtype)
    loss = -(log_probs * mask).sum() / float(max(global_loss_tokens, 1))
    with torch.no_grad():
        value = float(loss.detach())
        sums = {"loss": value, "pg_loss": value, "loss_tokens": float(mask.sum()), "clipped_tokens": 0.0,
                "entropy_sum": float((entropy.detach() * mask).sum()) if entropy is not None else 0.0,
                "kl_sum": 0.0, "logprob_abs_diff_sum": 0.0}
    return loss, sums, {"logprob_abs_diff_max": 0.0}


def loss_function(loss_type: str) -> Callable[..., tuple[torch.Tensor, dict[str, float], dict[str, float]]]:
    """The loss of `--loss-type`: `sft_loss`, or the policy loss (`policy_loss`)."""
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {', '.join(LOSS_TYPES)}, got {loss_type!r}")
    return sft_loss if loss_type == "sft_loss" else policy_loss
