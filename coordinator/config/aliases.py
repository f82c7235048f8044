"""slime's and miles' spellings rewritten to rayless' own when a Config is built: their built-in hook paths
(`HOOK_ALIASES`), `--fully-async`, miles' `--dump-details DIR` (`apply_hook_aliases`), so the rest of rayless
only ever sees ours (the porting notice names each replacement). Invariant: an alias replaces a path the user
gave only with one of ours; any other path is left as given."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from coordinator.config.fields import ConfigError, flag_name
from coordinator.config.hooks import AGENTIC_GENERATE, MULTI_TURN_GENERATE
from coordinator.config.rollout import DEFAULT_ROLLOUT_FUNCTION
from coordinator.config.sft import SFT_ROLLOUT_FUNCTION

_NONZERO_STD = "coordinator.rollout.filters:reward_std_positive"
_OPD_REWARD = "coordinator.rollout.teacher:distill_reward"
_OPD_POST_PROCESS = "coordinator.rollout.teacher:distill_post_process"


@dataclass(frozen=True)
class HookAlias:
    ours: str
    #: The alias also turns on `--async-rollout` (slime's and miles' fully-async rollouts).
    async_rollout: bool = False


#: slime/miles built-in hook paths (flag field name, their path) → ours.
HOOK_ALIASES: dict[tuple[str, str], HookAlias] = {
    ("dynamic_sampling_filter_path", "slime.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std"):
        HookAlias(_NONZERO_STD),
    ("dynamic_sampling_filter_path", "miles.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std"):
        HookAlias(_NONZERO_STD),
    ("rollout_function_path", "slime.rollout.sglang_rollout.generate_rollout"): HookAlias(DEFAULT_ROLLOUT_FUNCTION),
    ("rollout_function_path", "miles.rollout.sglang_rollout.generate_rollout"): HookAlias(DEFAULT_ROLLOUT_FUNCTION),
    ("rollout_function_path", "miles.rollout.inference_rollout.inference_rollout_common.InferenceRolloutFn"):
        HookAlias(DEFAULT_ROLLOUT_FUNCTION),
    ("rollout_function_path", "slime.rollout.fully_async_rollout.generate_rollout_fully_async"):
        HookAlias(DEFAULT_ROLLOUT_FUNCTION, async_rollout=True),
    ("rollout_function_path", "miles.rollout.fully_async_rollout.FullyAsyncRolloutFn"):
        HookAlias(DEFAULT_ROLLOUT_FUNCTION, async_rollout=True),
    ("rollout_function_path", "slime.rollout.sft_rollout.generate_rollout"): HookAlias(SFT_ROLLOUT_FUNCTION),
    ("rollout_function_path", "miles.rollout.sft_rollout.generate_rollout"): HookAlias(SFT_ROLLOUT_FUNCTION),
    ("custom_generate_function_path", "miles.rollout.generate_hub.multi_turn.generate"):
        HookAlias(MULTI_TURN_GENERATE),
    ("custom_generate_function_path", "miles.rollout.generate_hub.agentic_tool_call.generate"):
        HookAlias(AGENTIC_GENERATE),
    # on-policy distillation's teacher hooks: rayless asks the teacher itself (`coordinator.rollout.teacher`)
    ("custom_rm_path", "slime.rollout.on_policy_distillation.reward_func"): HookAlias(_OPD_REWARD),
    ("custom_rm_path", "miles.rollout.on_policy_distillation.reward_func"): HookAlias(_OPD_REWARD),
    ("custom_reward_post_process_path", "slime.rollout.on_policy_distillation.post_process_rewards"):
        HookAlias(_OPD_POST_PROCESS),
    ("custom_reward_post_process_path", "miles.rollout.on_policy_distillation.post_process_rewards"):
        HookAlias(_OPD_POST_PROCESS),
}
_HOOK_FIELDS = ("rollout_function_path", "eval_function_path", "custom_rm_path", "dynamic_sampling_filter_path",
                "custom_generate_function_path", "custom_reward_post_process_path")


def apply_hook_aliases(values: dict[str, Any]) -> tuple[dict[str, Any], tuple[tuple[str, str, str], ...]]:
    """Converted flag values with slime/miles built-in hook paths replaced by ours (and miles' `--fully-async`
    folded into `--async-rollout`); returns them and the (flag, theirs, ours) replacements made."""
    values = dict(values)
    replaced: list[tuple[str, str, str]] = []
    for name in _HOOK_FIELDS:
        path = values.get(name)
        alias = HOOK_ALIASES.get((name, path)) if isinstance(path, str) else None
        if alias is None:
            continue
        values[name] = alias.ours
        if alias.async_rollout:
            values["async_rollout"] = True
        replaced.append((flag_name(name), path, alias.ours + (" with --async-rollout" if alias.async_rollout else "")))
    eval_data = values.get("eval_prompt_data")
    if isinstance(eval_data, tuple) and len(eval_data) == 1:  # slime's legacy form: one path is aime's
        values["eval_prompt_data"] = ("aime", eval_data[0])
        replaced.append(("--eval-prompt-data", eval_data[0], f"aime {eval_data[0]} (slime's legacy one-path form)"))
    if values.get("fully_async"):
        values["async_rollout"] = True
    if values.get("offload"):  # slime: --offload is both offloads
        values.setdefault("offload_train", True)
        values.setdefault("offload_rollout", True)
    details = values.get("dump_details")
    if details is not None:
        # miles: --dump-details DIR sets the rollout dump template under DIR (and its per-rank train dumps)
        if values.get("save_debug_rollout_data") is not None:
            raise ConfigError("--dump-details and --save-debug-rollout-data both say where rollouts are dumped "
                              "(--dump-details DIR means DIR/rollout_data/{rollout_id}.rld): give one")
        values["save_debug_rollout_data"] = dump_details_template(str(details))
    return values, tuple(replaced)


def dump_details_template(directory: str) -> str:
    """The rollout dump template of miles' `--dump-details DIR` (rayless' format, hence `.rld`, not `.pt`)."""
    return str(Path(directory) / "rollout_data" / "{rollout_id}.rld")
