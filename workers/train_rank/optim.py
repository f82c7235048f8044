"""Optimizer, learning-rate schedule and gradient clipping for a rank.

The schedule is Megatron's (`OptimizerParamScheduler.get_lr`, which slime uses), counted in optimizer steps:
step s (the number of steps already taken) gets, in this order,
- during warm-up (`s <= warmup`): `init + (lr - init) · s / warmup`, so the first step runs at `init`;
- `constant`: `lr`; past the decay span (`s > decay_steps`): `min_lr`;
- otherwise, with `t = (s - warmup) / (decay_steps - warmup)`: `linear` `min_lr + (lr - min_lr)(1 - t)`,
  `cosine` `min_lr + (lr - min_lr) · (1 + cos(π t)) / 2`.

Invariant: the schedule is a pure function of the step count, so restoring the scheduler's `last_epoch` from
a checkpoint restores the exact learning rate.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from workers.protocol.train_settings import OptimizerSettings


def build_optimizer(
    model: Any, *, lr: float, weight_decay: float, betas: tuple[float, float], eps: float
) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, betas=betas, eps=eps, foreach=False)


class LrSchedule:
    """Megatron's learning rate at a step, as a LambdaLR factor of `lr`; a class (not a lambda) so the
    scheduler's state_dict stays plain data."""

    def __init__(self, *, lr: float, min_lr: float = 0.0, style: str = "constant",
                 decay_steps: int | None = None, warmup_steps: float = 0, warmup_init_lr: float = 0.0) -> None:
        self.lr = lr
        self.min_lr = min_lr
        self.style = style
        self.decay_steps = decay_steps
        self.warmup_steps = warmup_steps
        self.warmup_init_lr = warmup_init_lr

    def lr_at(self, step: int) -> float:
        if self.warmup_steps > 0 and step <= self.warmup_steps:
            return self.warmup_init_lr + (self.lr - self.warmup_init_lr) * step / self.warmup_steps
        if self.style == "constant" or self.decay_steps is None:
            return self.lr
        if step > self.decay_steps:
            return self.min_lr
        span = self.decay_steps - self.warmup_steps
        ratio = (step - self.warmup_steps) / span if span > 0 else 1.0
        coefficient = 1.0 - ratio if self.style == "linear" else 0.5 * (math.cos(math.pi * ratio) + 1.0)
        return self.min_lr + coefficient * (self.lr - self.min_lr)

    def __call__(self, step: int) -> float:
        return self.lr_at(step) / self.lr if self.lr > 0 else 0.0


def build_scheduler(optimizer: torch.optim.Optimizer, schedule: LrSchedule) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)


def clip_gradients(model: Any, max_norm: float) -> float:
    """Clip to `max_norm` (<= 0: no clipping) and return the total norm before clipping."""
    params = [p for p in model.parameters() if p.grad is not None]
    if not params:
        return 0.0
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else float("inf"), foreach=False)
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    return float(norm)


def lr_schedule(settings: OptimizerSettings) -> LrSchedule:
    return LrSchedule(lr=settings.lr, min_lr=settings.min_lr, style=settings.lr_decay_style,
                      decay_steps=settings.lr_decay_steps, warmup_steps=settings.warmup,
                      warmup_init_lr=settings.warmup_init_lr)
