"""Optimizer, learning-rate schedule and gradient clipping for a rank.

Invariant: the schedule is a pure function of the step count (linear warm-up to `lr`, then constant), so
restoring the scheduler's `last_epoch` from a checkpoint restores the exact learning rate.
"""

from __future__ import annotations

from typing import Any

import torch


def build_optimizer(
    model: Any, *, lr: float, weight_decay: float, betas: tuple[float, float], eps: float
) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, betas=betas, eps=eps, foreach=False)


class WarmupFactor:
    """Linear warm-up multiplier; a class (not a lambda) so the scheduler's state_dict stays plain data."""

    def __init__(self, warmup_steps: int) -> None:
        self.warmup_steps = warmup_steps

    def __call__(self, step: int) -> float:
        if self.warmup_steps <= 0:
            return 1.0
        return min(1.0, (step + 1) / self.warmup_steps)


def build_scheduler(
    optimizer: torch.optim.Optimizer, *, warmup_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, WarmupFactor(warmup_steps))


def clip_gradients(model: Any, max_norm: float) -> float:
    """Clip to `max_norm` (<= 0: no clipping) and return the total norm before clipping."""
    params = [p for p in model.parameters() if p.grad is not None]
    if not params:
        return 0.0
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else float("inf"), foreach=False)
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    return float(norm)
