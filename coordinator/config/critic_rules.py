"""What a run with a critic (`--advantage-estimator ppo`) or per-token returns refuses, and miles' rule that an
asynchronous PPO run must choose an off-policy correction.

Owns `CRITIC_RULES` (run by `rules.validate` in its order). Each is upstream's where upstream has one:
- `--kl-coef` with `ppo` is refused with miles' reason (the critic never sees the reference's logprobs); with
  `reinforce_plus_plus` it stays refused (rayless has no per-token KL rewards);
- `--async-rollout` / `--fully-async` with `ppo` needs `--use-rollout-logprobs` or `--use-tis` (miles'
  `validate_async_off_policy_correction`, PR #1829; `--keep-old-actor`, its third choice, is not in rayless).
  As in miles the rule is the critic's only: rayless' policy loss is always the clipped (trust-region)
  objective, and miles does not require a correction of the critic-free estimators either;
- what the critic does not combine with yet is refused by name: LoRA (a full-weight critic beside adapters),
  `--disable-compute-advantages-and-returns`, an SFT loss. (`--colocate` offloads the critic with the policy.)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from coordinator.config.fields import ConfigError

if TYPE_CHECKING:
    from coordinator.config.settings import Config


def _uses_critic(config: Config) -> bool:
    return config.rollout.advantage_estimator == "ppo"


def kl_reward_shaping_is_supported(config: Config) -> None:
    estimator = config.rollout.advantage_estimator
    if not config.train.kl_coef:
        return
    if estimator == "ppo":
        raise ConfigError("--kl-coef (reward-level KL) with --advantage-estimator ppo: the critic's value targets "
                          "would not include the KL penalty applied to the policy's rewards (miles refuses the "
                          "pair): use --use-kl-loss --kl-loss-coef for KL regularization instead")
    if estimator.startswith("reinforce_plus_plus"):
        raise ConfigError(f"--kl-coef (reward shaping) with --advantage-estimator {estimator} needs per-token "
                          "rewards, which rayless does not have yet: use --use-kl-loss --kl-loss-coef instead")


def async_ppo_needs_a_correction(config: Config) -> None:
    rollout, train = config.rollout, config.train
    if not (rollout.async_rollout or rollout.fully_async) or not _uses_critic(config):
        return
    if train.use_rollout_logprobs or train.use_tis:
        return
    raise ConfigError(
        "--async-rollout / --fully-async with --advantage-estimator ppo needs an explicit off-policy correction (as miles, PR #1829): "
        "rollouts are generated before the current weight update while the old logprobs are recomputed by the "
        "current policy. Pass one of: --use-rollout-logprobs (the engine's logprobs as the ratio's denominator), "
        "--use-tis (truncated importance sampling); miles' third choice, --keep-old-actor, is not in rayless")


def critic_combines(config: Config) -> None:
    if not _uses_critic(config):
        return
    reasons = (
        (config.lora.enabled, "--lora-rank", "a full-weight critic beside LoRA adapters is not in rayless yet"),
        (config.sft.disable_compute_advantages_and_returns, "--disable-compute-advantages-and-returns",
         "PPO's advantages are the critic's GAE, computed on the ranks"),
        (config.sft.enabled, "--loss-type sft_loss", "an SFT run trains no policy-gradient loss"),
    )
    for refused, name, why in reasons:
        if refused:
            raise ConfigError(f"--advantage-estimator ppo (a critic) with {name}: {why}")


CRITIC_RULES: tuple[Callable[[Config], None], ...] = (
    kl_reward_shaping_is_supported,
    async_ppo_needs_a_correction,
    critic_combines,
)
