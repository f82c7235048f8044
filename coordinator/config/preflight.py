"""Start-up checks against the machine: files that must exist, hooks that must import, backends installed.

Owns `preflight(config)`, run by `rayless train` after the flags parse and before any process is launched or
port opened. Invariant: every failure is a `ConfigError` naming the flag (exit status 2). Hooks are resolved
here (their modules imported, the attribute found and callable), not when the rollout manager is built after
engines and ranks started. Only what the run's mode uses is checked.
"""

from __future__ import annotations

from pathlib import Path

from coordinator.config.fields import ConfigError
from coordinator.config.settings import Config


def preflight(config: Config) -> None:
    check_paths(config)
    check_hooks(config)
    check_rewards(config)
    check_metric_backends(config)


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
    where = "--eval-config" if config.eval.eval_config is not None else "--eval-prompt-data"
    for name, path in config.eval.eval_datasets:
        if path.startswith("builtin:"):
            from coordinator.rollout.tasks import builtin_task_name

            try:
                builtin_task_name(path)
            except (KeyError, ValueError) as error:
                raise ConfigError(f"{where} {name} {path}: {error}") from None
        elif not Path(path).is_file():
            raise ConfigError(f"{where} {name} {path}: no such file")
    load = config.checkpoint.load
    if load and not Path(load).exists():
        raise ConfigError(f"--load {load}: no such checkpoint directory")


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


def check_rewards(config: Config) -> None:
    """The rollout's reward type and each eval dataset's can score (IFBench installed for `ifbench`; every
    dataset has a reward, a key for a dict-valued one, `--rm-url` for `remote_rm`)."""
    from coordinator.rollout.reward_rules import RewardError, base_rule, ifbench_library

    if config.builds_rollout_fn and config.rollout.rm_type is not None:
        if base_rule(config.rollout.rm_type)[0].name == "ifbench":
            try:
                ifbench_library()
            except RewardError as error:
                raise ConfigError(f"--rm-type {config.rollout.rm_type}: {error}") from None
    if not (config.eval_fleet_enabled or config.rollout_engine_eval_enabled):
        return
    from coordinator.eval_settings import EvalSettings

    settings = EvalSettings.from_slices(config.eval, rollout=config.rollout, sglang=config.sglang)
    for dataset in settings.datasets:
        try:
            dataset.check()
        except ValueError as error:
            raise ConfigError(str(error)) from None


def check_metric_backends(config: Config) -> None:
    from coordinator.progress import missing_metric_backends

    missing = missing_metric_backends(tensorboard=config.logging.use_tensorboard, wandb=config.logging.use_wandb)
    if missing:
        raise ConfigError("; ".join(missing))
