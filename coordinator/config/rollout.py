"""The rollout slice: the model and prompts, how many samples a rollout holds and how they are drawn,
the user's hooks (rollout fn, eval fn, reward, filter), and the advantage estimator.

Owns these flags and the facts derived from them alone (`effective_over_sampling_batch_size`,
`samples_per_rollout`, `effective_eval_function_path`). Invariants: one flag chooses the reward
(`--rm-type` or `--custom-rm-path`); a rollout never requests fewer groups at a time than it accepts; `--rm-type`
and `--advantage-estimator` choices are read from the registries that implement them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from coordinator.config import values
from coordinator.config.fields import ConfigError, Slice, flag
from coordinator.data.lines import DEFAULT_MAX_LINE_BYTES

DEFAULT_ROLLOUT_FUNCTION = "coordinator.rollout.generate:DefaultRollout"


def _rm_types() -> list[str]:
    from coordinator.rewards.rules import rm_type_names

    return rm_type_names()


#: --advantage-estimator values rayless implements (`coordinator.rollout.advantages`)
ESTIMATORS = ("grpo", "gspo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "ppo")
#: Estimators slime has whose names we know, with why rayless refuses them.
UNSUPPORTED_ESTIMATORS = {
    "cispo": "its clipped-importance loss is not implemented",
}


def _multimodal_keys(text: str) -> str:
    """slime's `--multimodal-keys`: a JSON object of media type → column, for the media rayless serves."""
    import json

    from coordinator.data.media import media_types_problem

    values.json_object(text)
    problem = media_types_problem(json.loads(text))
    if problem is not None:
        raise ValueError(problem)
    return text


def _estimators() -> tuple[str, ...]:
    return ESTIMATORS + tuple(UNSUPPORTED_ESTIMATORS)


@dataclass(frozen=True)
class RolloutConfig(Slice):
    TITLE = "rollout"
    DESCRIPTION = "model, prompts, sampling, hooks, rewards and advantages"

    hf_checkpoint: str | None = flag(None, help="local Hugging Face model directory (policy, tokenizer, engines)",
                                      metavar="DIR")
    prompt_data: str | None = flag(None, help="prompts: a JSONL or Parquet file, or builtin:first_digit|copy|reverse",
                                    metavar="PATH")
    input_key: str = flag("prompt", help="prompt field in --prompt-data", secret=False)
    label_key: str | None = flag(None, help="label field in --prompt-data", secret=False)
    metadata_key: str | None = flag(None, help="metadata field in --prompt-data", secret=False)
    tool_key: str | None = flag(None, help="tools field in --prompt-data, handed to the chat template as "
                                "tools= (slime's flag; a list, or JSON text of one)", secret=False)
    multimodal_keys: str | None = flag(
        None, help="slime's JSON map of a media type to its --prompt-data column, e.g. '{\"image\": \"images\"}': "
        "each <image> in a prompt takes the row's next image (a path relative to the file, file://, a data URL "
        "or Parquet bytes); needs a vision-language --hf-checkpoint (docs/vlm.md)",
        parse=_multimodal_keys, metavar="JSON", secret=False)
    data_max_line_bytes: int = flag(
        DEFAULT_MAX_LINE_BYTES, help="largest line (or Parquet row) of --prompt-data and eval data files; a "
        "longer one is refused at start-up", minimum=1)
    apply_chat_template: bool = flag(False, help="wrap prompts with the tokenizer's chat template")
    apply_chat_template_kwargs: str | None = flag(
        None, help="slime's JSON object of keyword arguments for every chat-template rendering, e.g. "
        "'{\"enable_thinking\": false}'", parse=values.json_object, metavar="JSON")
    rollout_batch_size: int | None = flag(None, help="prompt groups accepted per rollout", minimum=1)
    n_samples_per_prompt: int = flag(1, help="samples generated per prompt (group size)", minimum=1)
    over_sampling_batch_size: int | None = flag(
        None, help="prompt groups requested at a time while filling a rollout (default: --rollout-batch-size)",
        minimum=1)
    num_rollout: int | None = flag(None, help="rollouts to run", minimum=1)
    rollout_max_response_len: int = flag(1024, help="max new tokens per sample", minimum=1)
    rollout_max_context_len: int | None = flag(None, help="prompt + response token limit (default: the engine's)",
                                               minimum=1)
    rollout_temperature: float = flag(1.0, help="sampling temperature", minimum=0)
    rollout_top_p: float = flag(1.0, help="nucleus sampling", above=0, maximum=1)
    rollout_top_k: int = flag(-1, help="top-k sampling (-1 = off)", minimum=1, also=(-1,))
    rollout_stop: tuple[str, ...] = flag((), help="stop strings")
    rollout_stop_token_ids: tuple[int, ...] = flag((), help="stop token ids", minimum=0)
    rollout_seed: int = flag(42, help="seed for prompt order and sampling", minimum=0)
    rollout_shuffle: bool = flag(False, help="shuffle prompts every epoch")
    disable_rollout_global_dataset: bool = flag(
        False, help="slime's: no prompt dataset is built from --prompt-data; the --rollout-function-path manages "
        "its own data")
    custom_reward_post_process_path: str | None = flag(
        None, help="slime's fn(args, samples) -> (raw_rewards, rewards): its rewards are the advantages, in place "
        "of the estimator's group normalisation", parse=values.hook_path, metavar="MODULE:NAME")
    log_reward_category: str | None = flag(
        None, help="slime's: log error_cat/<value>, the share of samples whose reward dict has each value under "
        "this key", secret=False)
    rollout_function_path: str = flag(DEFAULT_ROLLOUT_FUNCTION, help="rollout fn: module.path:Name (class or "
                                      "function)", parse=values.hook_path, metavar="MODULE:NAME")
    eval_function_path: str | None = flag(None, help="eval fn (default: the rollout fn; the same path shares one "
                                          "instance)", parse=values.hook_path, metavar="MODULE:NAME")
    custom_rm_path: str | None = flag(None, help="custom reward: module.path:fn (sync or async)",
                                      parse=values.hook_path, metavar="MODULE:NAME")
    rm_type: str | None = flag(None, help="built-in reward (docs/rewards.md)", choices=_rm_types)
    rm_url: str | None = flag(None, help="reward service of --rm-type remote_rm (POST {prompt, response, label})",
                              parse=values.http_url, metavar="URL")
    reward_key: str | None = flag(None, help="key of a dict reward used for advantages", secret=False)
    group_rm: bool = flag(False, help="the custom reward scores a whole group at once")
    advantage_estimator: str = flag("grpo", help="advantage estimator", choices=_estimators)
    normalize_advantages: bool = flag(False, help="whiten advantages over every loss token of the rollout "
                                      "(mean 0, std 1), as slime; required by reinforce_plus_plus(_baseline)")
    disable_grpo_std_normalization: bool = flag(False, help="GRPO advantages without dividing by the group std")
    dynamic_sampling_filter_path: str | None = flag(
        None, help="group filter module.path:fn, e.g. coordinator.rollout.filters:reward_std_positive",
        parse=values.hook_path, metavar="MODULE:NAME")
    partial_rollout: bool = flag(False, help="keep aborted stragglers' partial tokens for the next rollout")
    async_rollout: bool = flag(False, help="generate rollout k+1 while step k trains (one step off-policy)")
    fully_async: bool = flag(False, help="miles' name for --async-rollout")
    max_weight_staleness: int = flag(1, help="max weight versions a trained sample may lag", minimum=0)

    def check(self) -> None:
        if self.hf_checkpoint is None:
            raise ConfigError("--hf-checkpoint is required (a local Hugging Face model directory)")
        if self.advantage_estimator in UNSUPPORTED_ESTIMATORS:
            raise ConfigError(f"--advantage-estimator {self.advantage_estimator}: not supported: "
                              f"{UNSUPPORTED_ESTIMATORS[self.advantage_estimator]}")
        if self.advantage_estimator.startswith("reinforce_plus_plus") and not self.normalize_advantages:
            raise ConfigError(f"--advantage-estimator {self.advantage_estimator} needs --normalize-advantages "
                              "(as slime: its advantages are whitened over the rollout's tokens)")
        if self.rm_type is not None and self.custom_rm_path is not None:
            raise ConfigError("--rm-type and --custom-rm-path both choose the reward: give one")
        self._check_rm_type()
        if self.group_rm and self.custom_rm_path is None:
            raise ConfigError("--group-rm applies to --custom-rm-path, which is not set")
        if (self.over_sampling_batch_size is not None and self.rollout_batch_size is not None
                and self.over_sampling_batch_size < self.rollout_batch_size):
            raise ConfigError(
                f"--over-sampling-batch-size {self.over_sampling_batch_size} is smaller than "
                f"--rollout-batch-size {self.rollout_batch_size}"
            )

    def _check_rm_type(self) -> None:
        if self.rm_type is None:
            return
        from coordinator.rewards.rules import REMOTE_RM, base_rule

        rule, _ = base_rule(self.rm_type)
        if rule.returns_dict and self.reward_key is None:
            raise ConfigError(f"--rm-type {self.rm_type} returns a dict reward (score, acc): pass --reward-key "
                              "score (as slime's scripts do) to choose the entry advantages use")
        if rule.name == REMOTE_RM and self.rm_url is None:
            raise ConfigError("--rm-type remote_rm needs --rm-url (the reward service to POST to)")

    @property
    def effective_over_sampling_batch_size(self) -> int:
        return self.over_sampling_batch_size or self.rollout_batch_size or 0

    @property
    def samples_per_rollout(self) -> int:
        return (self.rollout_batch_size or 0) * self.n_samples_per_prompt

    @property
    def effective_eval_function_path(self) -> str:
        return self.eval_function_path or self.rollout_function_path

    @property
    def shares_rollout_and_eval_fn(self) -> bool:
        return self.effective_eval_function_path == self.rollout_function_path

    @property
    def chat_template_kwargs(self) -> dict[str, Any]:
        import json

        return json.loads(self.apply_chat_template_kwargs) if self.apply_chat_template_kwargs else {}

    @property
    def multimodal_key_map(self) -> dict[str, str] | None:
        """`--multimodal-keys` as its map (None: text prompts)."""
        import json

        return json.loads(self.multimodal_keys) if self.multimodal_keys else None

