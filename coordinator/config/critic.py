"""The critic slice: PPO's value model and the discounting of per-token returns (slime's and miles' `--gamma`,
`--lambd`, `--critic-*`, `--num-critic-only-steps`, `--value-clip`).

Owns these flags, `token_level_returns` (whether the ranks compute per-token advantages: `ppo`, and
`reinforce_plus_plus` with `--gamma` < 1) and `rank_returns` / `rank_critic` (the ranks' settings). Names and
defaults are upstream's (`slime/utils/arguments.py`, `miles/utils/arguments.py`): `--gamma` and `--lambd` 1.0,
`--value-clip` 0.2, `--num-critic-only-steps` 0, `--critic-lr` defaulting to `--lr` and `--critic-load` to
`--load` (miles' `use_critic = advantage_estimator == "ppo"`). One difference, said by `--critic-save`'s help:
the critic is saved inside the policy's checkpoint under `--save`, not in a sibling directory.

Invariant: a critic is built exactly when `--advantage-estimator ppo`; its flags are otherwise unused, as upstream.
"""

from __future__ import annotations

from dataclasses import dataclass

from coordinator.config.fields import Slice, flag
from workers.protocol.train_settings import CriticSettings, ReturnsSettings


@dataclass(frozen=True)
class CriticConfig(Slice):
    TITLE = "critic"
    DESCRIPTION = ("PPO's value model (--advantage-estimator ppo) and discounted per-token returns "
                   "(docs/training.md#ppo-with-a-critic)")

    gamma: float = flag(1.0, help="discount of PPO's GAE and REINFORCE++'s returns", minimum=0, maximum=1)
    lambd: float = flag(1.0, help="GAE's lambda (with --advantage-estimator ppo)", minimum=0, maximum=1)
    critic_lr: float | None = flag(None, help="the critic's learning rate (default: --lr)", minimum=0)
    critic_lr_warmup_iters: int = flag(0, help="optimizer steps of the critic's linear warm-up from 0", minimum=0)
    critic_load: str | None = flag(None, help="a rayless checkpoint whose critic starts this run (default: --load, "
                                   "whose checkpoint restores the critic with the policy; without either, the "
                                   "policy's weights with a fresh value head)", metavar="DIR")
    critic_save: str | None = flag(None, help="miles' critic save directory: accepted; rayless saves the critic "
                                   "inside the policy's checkpoint under --save", metavar="DIR")
    num_critic_only_steps: int = flag(0, help="first rollouts that train the critic alone (value warm-up)", minimum=0)
    value_clip: float = flag(0.2, help="the clip of the value loss: max((clip(V, V_old ± c) - G)², (V - G)²)",
                             minimum=0)

    def token_level_returns(self, estimator: str) -> bool:
        """Whether the ranks compute this run's per-token advantages (the samples carry the scalar reward)."""
        return estimator == "ppo" or (estimator == "reinforce_plus_plus" and self.gamma < 1.0)

    def rank_returns(self, estimator: str, *, normalize: bool) -> ReturnsSettings | None:
        if not self.token_level_returns(estimator):
            return None
        return ReturnsSettings(estimator=estimator, gamma=self.gamma, lambd=self.lambd, normalize=normalize)

    def rank_critic(self, estimator: str, *, lr: float, load_path: str | None) -> CriticSettings | None:
        """`load_path`: where the critic's weights come from when not the policy's (resolved by the caller)."""
        if estimator != "ppo":
            return None
        return CriticSettings(lr=lr if self.critic_lr is None else self.critic_lr,
                              warmup_steps=self.critic_lr_warmup_iters, value_clip=self.value_clip,
                              critic_only_steps=self.num_critic_only_steps, load_path=load_path)
