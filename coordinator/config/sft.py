"""The SFT slice: slime's supervised fine-tuning flags (`--loss-type`, `--loss-mask-type`, `--num-epoch`,
`--disable-compute-advantages-and-returns`) and the cross-slice rules that keep an SFT run meaningful.

Owns these flags, `SFT_ROLLOUT_FUNCTION` (ours, which slime's and miles' `sft_rollout.generate_rollout` paths
alias to) and `SFT_RULES`, appended to `rules.RULES`. Invariants: an SFT run (`--loss-type sft_loss`) starts
no engines (`Config.train_only`); every flag that only means something with engines, rewards or a policy
gradient is refused at start-up naming the flags, never silently ignored; `--num-epoch` becomes a number of
rollouts only once the data is counted (`coordinator.rollout.epochs`).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from coordinator.config.fields import ConfigError, ConfigWarning, Slice, flag

if TYPE_CHECKING:
    from coordinator.config.settings import Config

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
    num_epoch: int | None = flag(None, help="epochs over --prompt-data: --num-rollout = epochs × records // "
                                 "--rollout-batch-size (slime's rule; --num-rollout wins when both are given)",
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


def sft_trains_without_engines(config: Config) -> None:
    """sft_loss learns from data: every flag that launches, attaches or uses engines cannot mean anything."""
    if not config.sft.enabled:
        return
    cluster, given = config.cluster, []
    given += ["--rollout-num-engines"] if cluster.rollout_num_engines else []
    given += ["--rollout-num-gpus"] if cluster.rollout_num_gpus else []
    given += ["--rollout-external-engine-addrs"] if cluster.rollout_external_engine_addrs else []
    given += ["--use-sglang-router"] if config.sglang.use_sglang_router else []
    given += ["--eval-num-engines/--eval-num-gpus"] if config.eval.eval_num_engines or config.eval.eval_num_gpus \
        else []
    given += ["--custom-generate-function-path"] if config.hooks.custom_generate_function_path else []
    given += ["--debug-rollout-only"] if config.debug.debug_rollout_only else []
    if given:
        raise ConfigError(f"--loss-type sft_loss trains on the data's own tokens and starts no engines; "
                          f"{', '.join(given)} cannot mean anything in such a run: drop them")


def sft_has_no_policy_terms(config: Config) -> None:
    """The NLL has no ratio, reference or importance weight: the policy loss's terms are contradictions."""
    if not config.sft.enabled:
        return
    train = config.train
    given = [name for name, on in (("--use-kl-loss", train.use_kl_loss), ("--use-tis", train.use_tis),
                                   ("--use-rollout-logprobs", train.use_rollout_logprobs),
                                   ("--entropy-coef", bool(train.entropy_coef))) if on]
    if given:
        raise ConfigError(f"--loss-type sft_loss is the negative log-likelihood of the data; {', '.join(given)}: "
                          "terms of the policy loss (policy_loss), which the NLL does not have: drop them")


def sft_rollout_pairs_with_sft_loss(config: Config) -> None:
    """The SFT rollout makes samples with no reward or logprobs, and sft_loss needs samples that are data."""
    from coordinator.config.rollout import DEFAULT_ROLLOUT_FUNCTION

    rollout, sft = config.rollout, config.sft
    if rollout.rollout_function_path == SFT_ROLLOUT_FUNCTION and not sft.enabled and not config.replay_mode:
        raise ConfigError("--rollout-function-path slime.rollout.sft_rollout.generate_rollout makes chat data "
                          "samples with no rewards to take a policy gradient of: add --loss-type sft_loss")
    if not sft.enabled or config.replay_mode:
        return
    if rollout.rollout_function_path == DEFAULT_ROLLOUT_FUNCTION:
        raise ConfigError("--loss-type sft_loss starts no engines, so the default rollout function cannot "
                          "generate: give --rollout-function-path slime.rollout.sft_rollout.generate_rollout "
                          "(chat data from --prompt-data) or a rollout function of your own that produces data")
    if rollout.rollout_function_path == SFT_ROLLOUT_FUNCTION:
        if rollout.disable_rollout_global_dataset or not rollout.prompt_data:
            raise ConfigError("the SFT rollout reads its chats from --prompt-data (slime asserts "
                              "rollout_global_dataset): give --prompt-data and drop --disable-rollout-global-dataset")
        if rollout.n_samples_per_prompt != 1:
            raise ConfigError(f"--n-samples-per-prompt {rollout.n_samples_per_prompt}: the SFT rollout makes one "
                              "sample per chat (slime's takes groups of one)")


def num_epoch_needs_a_dataset(config: Config) -> None:
    """slime: `--num-epoch` counts passes over the global dataset; `--num-rollout` wins when both are given."""
    sft, rollout = config.sft, config.rollout
    if sft.num_epoch is None:
        return
    if rollout.num_rollout is not None:
        warnings.warn(f"--num-epoch {sft.num_epoch} is ignored: --num-rollout {rollout.num_rollout} is given (as "
                      "slime)", ConfigWarning, stacklevel=3)
        return
    if config.replay_mode:
        raise ConfigError("--num-epoch counts passes over --prompt-data; --load-debug-rollout-data replays dumps: "
                          "give --num-rollout, or nothing to replay every dump")
    if rollout.disable_rollout_global_dataset or not rollout.prompt_data:
        raise ConfigError("--num-epoch counts passes over --prompt-data, the global dataset: give --prompt-data "
                          "and drop --disable-rollout-global-dataset (slime's rule), or give --num-rollout")


#: appended to `rules.RULES`, in this order.
SFT_RULES: tuple[Callable[[Config], None], ...] = (
    sft_trains_without_engines,
    sft_has_no_policy_terms,
    sft_rollout_pairs_with_sft_loss,
    num_epoch_needs_a_dataset,
)
