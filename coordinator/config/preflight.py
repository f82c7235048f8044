"""Start-up checks against the machine: files that must exist, hooks that must import, backends installed.

Owns `preflight(config)`, run by `rayless train` after the flags parse and before any process is launched or
port opened; it ends by warning the grouped `PortingNotice` about flags from slime/miles scripts. Invariant: every failure is a `ConfigError` naming the flag (exit status 2). Hooks are resolved
here (their modules imported, the attribute found and callable), not when the rollout manager is built after
engines and ranks started. Only what the run's mode uses is checked.
"""

from __future__ import annotations

import warnings
from pathlib import Path

from coordinator.config.fields import ConfigError
from coordinator.config.porting import LoadPlan, PortingNotice, porting_notice, resolve_load, resolve_ref_load
from coordinator.config.settings import Config


def preflight(config: Config) -> None:
    check_paths(config)
    load = check_checkpoints(config)
    check_hooks(config)
    check_metric_backends(config)
    notice = porting_notice(config, load=load)
    if notice is not None:
        warnings.warn(notice, PortingNotice, stacklevel=2)


def check_checkpoints(config: Config) -> LoadPlan:
    """What `--load` and `--ref-load` hold (slime's rules; a Megatron checkpoint is refused with what to pass)."""
    resolve_ref_load(config)
    return resolve_load(config)


def check_paths(config: Config) -> None:
    """The model directory, prompt and eval files, and the checkpoint to resume from exist."""
    rollout = config.rollout
    checkpoint = Path(rollout.hf_checkpoint or "")
    if not (checkpoint / "config.json").is_file():
        raise ConfigError(f"--hf-checkpoint {rollout.hf_checkpoint}: not a Hugging Face model directory "
                          "(no config.json); build one with `rayless make-tiny-model DIR`")
    if rollout.prompt_data and not rollout.prompt_data.startswith("builtin:") and not config.replay_mode:
        if not Path(rollout.prompt_data).is_file():
            raise ConfigError(f"--prompt-data {rollout.prompt_data}: no such file")
    for name, path in config.eval.eval_datasets:
        if not path.startswith("builtin:") and not Path(path).is_file():
            raise ConfigError(f"--eval-prompt-data {name} {path}: no such file")


def hooks_in_use(config: Config) -> list[tuple[str, str]]:
    """(flag, path) of every hook this run's mode will load."""
    if not config.builds_rollout_fn:
        return []  # replay loads no rollout fn, reward or filter
    rollout = config.rollout
    hooks = [("--rollout-function-path", rollout.rollout_function_path)]
    if rollout.eval_function_path is not None:
        hooks.append(("--eval-function-path", rollout.eval_function_path))
    if rollout.custom_rm_path is not None:
        hooks.append(("--custom-rm-path", rollout.custom_rm_path))
    if rollout.dynamic_sampling_filter_path is not None:
        hooks.append(("--dynamic-sampling-filter-path", rollout.dynamic_sampling_filter_path))
    return hooks


def check_hooks(config: Config) -> None:
    """Each hook path imports and names a callable (a class counts: rollout fns may be classes)."""
    from coordinator.rollout.loading import HookLoadError, load_object

    for flag, path in hooks_in_use(config):
        try:
            target = load_object(path, what=flag)
        except HookLoadError as error:
            raise ConfigError(str(error)) from None
        if not callable(target):
            raise ConfigError(f"{flag} {path!r} names a {type(target).__name__}, not a function or class")


def check_metric_backends(config: Config) -> None:
    from coordinator.progress import missing_metric_backends

    missing = missing_metric_backends(tensorboard=config.logging.use_tensorboard, wandb=config.logging.use_wandb)
    if missing:
        raise ConfigError("; ".join(missing))
