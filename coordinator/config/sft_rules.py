"""The cross-slice rules of an SFT run (`--loss-type sft_loss`) and of `--num-epoch`, appended to `rules.RULES`.

Owns `SFT_RULES`. Invariant: every flag that only means something with engines, rewards or a policy gradient is
refused at start-up in an SFT run, naming the flags, never silently ignored; slime's `--num-epoch` rules
(`--num-rollout` wins; a global dataset is needed) hold.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING

from coordinator.config.fields import ConfigError, ConfigWarning
from coordinator.config.sft import SFT_ROLLOUT_FUNCTION

if TYPE_CHECKING:
    from coordinator.config.settings import Config


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
