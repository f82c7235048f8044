"""The SFT slice: slime's supervised fine-tuning flags (`--loss-type`, `--loss-mask-type`, `--num-epoch`,
`--disable-compute-advantages-and-returns`).

Owns these flags and `SFT_ROLLOUT_FUNCTION` (ours, which slime's and miles' `sft_rollout.generate_rollout` paths
alias to). Invariants: an SFT run (`--loss-type sft_loss`) starts no engines (`Config.train_only`); the rules
across slices that keep it meaningful are `sft_rules`'; `--num-epoch` becomes a number of rollouts only once
the data is counted (`coordinator.rollout.epochs`).
"""

from __future__ import annotations

from dataclasses import dataclass

from coordinator.config.fields import ConfigError, Slice, flag

LOSS_TYPES = ("policy_loss", "sft_loss", "custom_loss")
#: slime's `MultiTurnLossMaskGenerator` tokenizer types (miles has the first two and the last).
LOSS_MASK_TYPES = ("qwen", "qwen3", "qwen3_5", "distill_qwen")
SFT_ROLLOUT_FUNCTION = "coordinator.rollout.sft:SftRollout"


@dataclass(frozen=True)
class SftConfig(Slice):
    TITLE = "sft"
    DESCRIPTION = "supervised fine-tuning on chat data (slime's --loss-type sft_loss), epochs over the data"

    loss_type: str = flag("policy_loss", help="policy_loss: the policy gradient; sft_loss: negative log-likelihood "
                          "of the loss-mask tokens (the assistant turns), token mean; starts no engines",
                          choices=LOSS_TYPES)
    loss_mask_type: str = flag("qwen", help="slime's rule for which tokens of a chat are trained (the assistant "
                               "turns' content and end marker): qwen, qwen3 (tool turns grouped), qwen3_5 (by "
                               "characters, needs a fast tokenizer), distill_qwen (the last message only)",
                               choices=LOSS_MASK_TYPES)
    num_epoch: int | None = flag(None, help="epochs over --prompt-data: --num-rollout = epochs × (records // "
                                 "--rollout-batch-size) (slime's rule; --num-rollout wins when both are given)",
                                 minimum=1)
    disable_compute_advantages_and_returns: bool = flag(
        False, help="keep the advantages the rollout function set (0 unless it sets them) instead of computing "
        "them from the rewards (slime: for SFT or a custom loss)")

    def check(self) -> None:
        if self.loss_type == "custom_loss":
            raise ConfigError("--loss-type custom_loss: custom loss functions are refused (slime's signature takes "
                              "Megatron's logits and packed batch, which rayless' ranks do not have); use "
                              "policy_loss or sft_loss")

    @property
    def enabled(self) -> bool:
        """An SFT run: no engines, the NLL loss on the ranks."""
        return self.loss_type == "sft_loss"
