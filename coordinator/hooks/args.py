"""The `args` namespace slime-style hooks get: slime's attribute names, built from the config slices here and
nowhere else.

Owns `build_hook_args(config)` and `hook_sampling_params(config)` (slime's `GenerateState.sampling_params`).
Every flag appears under its field name (rayless' flag names are slime's: `args.rollout_max_response_len`,
`args.n_samples_per_prompt`, `args.partial_rollout`, `args.max_tokens_per_gpu`, ...), lists where slime has
lists; then the attributes slime derives or that rayless has no flag for, with slime's values; then the
`--custom-config-path` keys that name no flag (slime's `setattr(args, k, v)`).

Invariants: no secret reaches a hook (`--sglang-api-key`, `--wandb-key` and every other secret flag are None
here; `post` adds the engines' key itself where it belongs); `sglang_router_ip/port` are the address the run
binds (`HookRuntime.bind_address`): the coordinator's endpoint, or the router in use.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from coordinator.config import Config


def _plain(value: Any) -> Any:
    if isinstance(value, frozenset | set):
        return sorted(value)
    if isinstance(value, tuple):
        return list(value)
    return value


def build_hook_args(config: Config) -> argparse.Namespace:
    """slime's `args` for this run (the router address is filled in when the run binds it)."""
    from coordinator.config.flags import FLAGS

    values: dict[str, Any] = {}
    for name, value in config.flat().items():
        values[name] = None if FLAGS[name][1].secret else _plain(value)
    cluster, megatron = config.cluster, config.megatron
    derived = {
        # slime's sizes: rollout GPUs (CPU engines count one each), per engine, and the DP size SGLang uses.
        "rollout_num_gpus": cluster.rollout_num_gpus or config.num_launched_rollout_engines,
        "sglang_dp_size": 1,
        "context_parallel_size": getattr(megatron, "context_parallel_size", None) or 1,
        "eval_max_context_len": config.rollout.rollout_max_context_len,
        "rollout_skip_special_tokens": False,
        "apply_chat_template_kwargs": config.rollout.chat_template_kwargs,
        "mask_offpolicy_in_partial_rollout": False,
        "use_rollout_routing_replay": False,
        "use_rollout_indexer_replay": False,
        "sglang_speculative_algorithm": None,
        "save_debug_trajectory_data": None,
        "rollout_global_dataset": not config.rollout.disable_rollout_global_dataset,
        "fully_async": config.rollout.async_rollout,
    }
    for name, value in derived.items():
        if values.get(name) is None:
            values[name] = value
    values["apply_chat_template_kwargs"] = config.rollout.chat_template_kwargs  # a dict, as slime's json.loads
    # The address hooks post to: unknown until the run binds its endpoint (or names the router it uses).
    values["sglang_router_ip"] = None
    values["sglang_router_port"] = None
    for name, value in config.custom_attributes:
        values[name] = value
    return argparse.Namespace(**values)


def plain_args(args: argparse.Namespace) -> dict[str, Any]:
    """The attributes of `args` that travel as plain data (to the training ranks, for a TIS hook)."""
    def plain(value: Any) -> bool:
        if value is None or isinstance(value, bool | int | float | str):
            return True
        if isinstance(value, list):
            return all(plain(item) for item in value)
        return isinstance(value, dict) and all(isinstance(k, str) and plain(v) for k, v in value.items())

    return {name: value for name, value in vars(args).items() if not name.startswith("_") and plain(value)}


def hook_sampling_params(config: Config) -> dict[str, Any]:
    """slime's `GenerateState.sampling_params` (each hook call gets its own copy)."""
    rollout = config.rollout
    params: dict[str, Any] = {
        "temperature": rollout.rollout_temperature,
        "top_p": rollout.rollout_top_p,
        "top_k": rollout.rollout_top_k,
        "max_new_tokens": rollout.rollout_max_response_len,
        "skip_special_tokens": False,
        "no_stop_trim": True,
        "spaces_between_special_tokens": False,
    }
    if rollout.rollout_stop:
        params["stop"] = list(rollout.rollout_stop)
    if rollout.rollout_stop_token_ids:
        params["stop_token_ids"] = list(rollout.rollout_stop_token_ids)
    return params


def tis_hook_args(config: Config) -> dict[str, Any] | None:
    """With `--custom-tis-function-path`, the hook's `args` as plain data for the ranks (slime's namespace,
    which only this layer builds; `coordinator.train.settings.train_settings` takes it); None otherwise."""
    if config.train.custom_tis_function_path is None:
        return None
    return plain_args(build_hook_args(config))
