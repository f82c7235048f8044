"""Per-token advantages and returns of one response, computed on the rank: slime's GAE (`--advantage-estimator
ppo`) and REINFORCE++'s discounted returns (`reinforce_plus_plus` with `--gamma`).

Owns `gae`, `discounted_returns`, `token_rewards` and `whiten`. The formulas are slime's
(`slime/utils/ppo_utils.py`: `vanilla_gae`, `get_reinforce_plus_plus_returns`; `slime/backends/megatron_utils/
loss.py`: `compute_advantages_and_returns`), over one response of T tokens:
- PPO: the reward sits on the response's last token (`r_t = 0`, `r_{T-1} = R`); with `V_T = 0`,
  `δ_t = r_t + γ V_{t+1} - V_t`, `A_t = δ_t + γλ A_{t+1}`, returns `G_t = A_t + V_t`.
- REINFORCE++: the reward sits on the last loss-mask token; `G_t = r_t + γ G_{t+1}`, and `A_t = G_t`.
- `--normalize-advantages`: `(A - mean) / sqrt(var + 1e-8)` over the loss tokens of every rank (slime's
  `distributed_masked_whiten`, variance with Bessel's correction).

Invariant: a pure function of its inputs computed in float64 and returned as float32; the recurrences run
backwards over the response exactly as written above (a reference the tests check against is independent).
--kl-coef's per-token KL rewards are not part of it: a PPO or REINFORCE++ run with --kl-coef is refused at
start-up (miles refuses the pair for PPO).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

WHITEN_EPSILON = 1e-8


def token_rewards(reward: float, length: int, *, at: int | None = None) -> torch.Tensor:
    """[T] float64: `reward` at position `at` (default: the last), zero elsewhere."""
    rewards = torch.zeros(length, dtype=torch.float64)
    if length:
        rewards[length - 1 if at is None else at] = reward
    return rewards


def gae(rewards: torch.Tensor, values: torch.Tensor, *, gamma: float, lambd: float
        ) -> tuple[torch.Tensor, torch.Tensor]:
    """[T] rewards and [T] values → ([T] advantages, [T] returns), float32 (slime's `vanilla_gae`)."""
    rewards, values = rewards.double(), values.double()
    length = rewards.shape[0]
    advantages = torch.zeros(length, dtype=torch.float64)
    running = 0.0
    for t in reversed(range(length)):
        next_value = values[t + 1] if t + 1 < length else 0.0
        delta = rewards[t] + gamma * next_value - values[t]
        running = delta + gamma * lambd * running
        advantages[t] = running
    return advantages.float(), (advantages + values).float()


def discounted_returns(rewards: torch.Tensor, *, gamma: float) -> torch.Tensor:
    """[T] rewards → [T] `G_t = r_t + γ G_{t+1}`, float32 (slime's `chunked_discounted_returns`, one row)."""
    rewards = rewards.double()
    returns = torch.zeros_like(rewards)
    running = 0.0
    for t in reversed(range(rewards.shape[0])):
        running = rewards[t] + gamma * running
        returns[t] = running
    return returns.float()


def reinforce_returns(reward: float, loss_mask: torch.Tensor, *, gamma: float) -> torch.Tensor:
    """[T] REINFORCE++ returns of one response: the reward on its last loss token, discounted backwards."""
    kept = loss_mask.nonzero()
    at = int(kept[-1]) if kept.numel() else None
    if at is None:
        return torch.zeros(loss_mask.shape[0], dtype=torch.float32)
    return discounted_returns(token_rewards(reward, loss_mask.shape[0], at=at), gamma=gamma)


def whiten(values: list[torch.Tensor], masks: list[torch.Tensor]) -> list[torch.Tensor]:
    """Whitened `values` with the mean and variance of their masked entries over every rank (a collective
    when torch.distributed runs: every rank calls it once per train command)."""
    device = values[0].device if values else torch.device("cpu")
    stats = torch.zeros(3, dtype=torch.float64, device=device)
    for value, mask in zip(values, masks, strict=True):
        value, mask = value.double(), mask.double()
        stats += torch.stack([(value * mask).sum(), (value * value * mask).sum(), mask.sum()])
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(stats, op=dist.ReduceOp.SUM)
    total, squares, count = (float(x) for x in stats)
    if count == 0:
        return values
    mean = total / count
    variance = max(squares / count - mean * mean, 0.0)
    if count >= 2:
        variance *= count / (count - 1)
    scale = (variance + WHITEN_EPSILON) ** -0.5
    return [((value.double() - mean) * scale).float() for value in values]
