"""Start-up checks against the machine: files that must exist, data that must hold the keys asked for, hooks
that must import and accept the calls they will get, checkpoint directories, backends installed.

Owns `preflight(config)`, run by `rayless train` after the flags parse and before any process is launched or
port opened (and by `--dry-run`, which reports every check's outcome). Invariant: every failure is a
`ConfigError` naming the flag (exit status 2). Hooks are resolved here (their modules imported, the attribute
found, callable with the arguments rayless passes), not when the rollout manager is built after engines and
ranks started. Only what the run's mode uses is checked. Each check returns short notes of what it found,
for `--dry-run` to print; the last step warns the grouped `PortingNotice` about flags from slime/miles scripts.
"""

from __future__ import annotations

import inspect
import os
import warnings
from pathlib import Path
from typing import Any

from coordinator.config.checkpoint import LoadPlan, save_hf_path
from coordinator.config.fields import ConfigError
from coordinator.config.porting import PortingNotice, porting_notice
from coordinator.config.settings import Config


def preflight(config: Config) -> list[str]:
    """Every check; the notes of what was found (`--dry-run` prints them)."""
    notes = [*check_paths(config)]
    load_notes, load = check_checkpoints(config)
    notes += [*load_notes, *check_data(config), *check_hooks(config), *check_rewards(config),
              *check_metric_backends(config), *check_status_port(config)]
    from coordinator.checks.trainable import check_trainable

    notes += check_trainable(config)  # with LoRA: the targets against the model
    notice = porting_notice(config, load=load)
    if notice is not None:
        warnings.warn(notice, PortingNotice, stacklevel=2)
    return notes


def check_status_port(config: Config) -> list[str]:
    """`--status-port` free on `--status-host` now (it is bound again once the services are up)."""
    settings = config.logging
    if not settings.status_port:
        return []
    from coordinator.engines.spec import port_is_free

    where = f"{settings.status_host}:{settings.status_port}"
    if ":" not in settings.status_host and not port_is_free(settings.status_host, settings.status_port):
        raise ConfigError(f"--status-port {settings.status_port}: {where} is in use or cannot be bound; give "
                          "another port")
    return [f"--status-port {settings.status_port}: the status page at http://{where}"]


def check_checkpoints(config: Config) -> tuple[list[str], LoadPlan]:
    """What `--load` and `--ref-load` hold (slime's rules: a `--load` that does not exist yet starts fresh; a
    Megatron checkpoint is refused with what to pass), and that `--save` can be written."""
    notes = []
    ref = config.reference_path()
    if ref is not None:
        notes.append(f"--ref-load {ref}: the reference model")
    teacher = config.distill.teacher_path()
    if teacher is not None:
        served = "served by an engine rayless launches" if config.distill.launches_teacher else "on the ranks"
        notes.append(f"--opd-teacher-load {teacher}: the distillation teacher, {served}")
    load = config.load_plan()
    if load.resume:
        notes.append(f"--load {load.path}: resumes from this checkpoint")
    elif load.fresh_reason is not None:
        notes.append(f"--load {config.checkpoint.load}: {load.fresh_reason}; training starts fresh")
    save = config.checkpoint.save
    if save and config.needs_train_ranks:
        notes.append(_check_writable("--save", Path(save)))
    if config.checkpoint.save_hf and config.needs_train_ranks:
        notes.append(_check_save_hf(config.checkpoint.save_hf, hf_checkpoint=config.rollout.hf_checkpoint,
                                    save=save))
    return notes, load


def _check_save_hf(template: str, *, hf_checkpoint: str | None, save: str | None) -> str:
    """`--save-hf` can be written, never names the model the run starts from (slime's rule: a save there would
    replace the weights every engine and the next run load) nor `--save`, and its first directory holds nothing
    a save would refuse to replace (anything but an earlier model)."""
    first = Path(save_hf_path(template, 0))
    for flag, other in (("--hf-checkpoint", hf_checkpoint), ("--save", save)):
        if other is not None and first.resolve() == Path(other).resolve():
            raise ConfigError(f"--save-hf {template}: the {flag} directory itself; name another directory "
                              "(e.g. with {rollout_id} in it)")
    if first.is_dir() and any(first.iterdir()) and not (first / "config.json").is_file():
        raise ConfigError(f"--save-hf {template}: {first} holds files and is not a Hugging Face model directory "
                          "(no config.json); a save replaces only an earlier model or an empty directory")
    return _check_writable("--save-hf", first)


def check_paths(config: Config) -> list[str]:
    """The model directory, prompt and eval files exist."""
    rollout = config.rollout
    checkpoint = Path(rollout.hf_checkpoint or "")
    if not (checkpoint / "config.json").is_file():
        raise ConfigError(f"--hf-checkpoint {rollout.hf_checkpoint}: not a Hugging Face model directory "
                          "(no config.json); build one with `rayless make-tiny-model DIR`")
    notes = [f"--hf-checkpoint {rollout.hf_checkpoint}: a Hugging Face model directory"]
    if rollout.prompt_data and not rollout.prompt_data.startswith("builtin:") and not config.replay_mode:
        if not Path(rollout.prompt_data).is_file():
            raise ConfigError(f"--prompt-data {rollout.prompt_data}: no such file")
    where = "--eval-config" if config.eval.eval_config is not None else "--eval-prompt-data"
    for name, path in config.eval.eval_datasets:
        if path.startswith("builtin:"):
            from coordinator.data.tasks import builtin_task_name

            try:
                builtin_task_name(path)
            except (KeyError, ValueError) as error:
                raise ConfigError(f"{where} {name} {path}: {error}") from None
        elif not Path(path).is_file():
            raise ConfigError(f"{where} {name} {path}: no such file")
    return notes


def _check_writable(flag: str, directory: Path) -> str:
    """A directory that is (or can be created) writable: it, or its nearest existing parent, is writable."""
    if directory.exists() and not directory.is_dir():
        raise ConfigError(f"{flag} {directory}: exists and is not a directory")
    existing = directory
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not os.access(existing, os.W_OK | os.X_OK):
        where = "it" if existing == directory else f"its parent {existing}"
        raise ConfigError(f"{flag} {directory}: cannot be written ({where} is not writable by this user)")
    return f"{flag} {directory}: writable" + ("" if existing == directory else f" (will be created in {existing})")


def check_data(config: Config) -> list[str]:
    """Every record of `--prompt-data` and of each eval dataset, streamed once (`coordinator.data.check`):
    valid bounded JSON holding the input key (and label and metadata keys when given) with values of the right
    kinds. Eval datasets are read with their own keys (`--eval-input-key`, `--eval-config`), falling back to
    the rollout's."""
    if config.replay_mode:
        return []
    rollout = config.rollout
    sources: list[tuple[str, str, str, str | None, str | None]] = []
    # The custom generate function reads any prompt value (evaluation on the rollout engines uses it too).
    custom = config.hooks.custom_generate_function_path is not None
    if rollout.prompt_data:
        sources.append(("--prompt-data", rollout.prompt_data, rollout.input_key, rollout.label_key,
                        rollout.metadata_key))
    if config.eval.eval_datasets:
        from coordinator.eval.settings import EvalSettings

        where = "--eval-config" if config.eval.eval_config is not None else "--eval-prompt-data"
        settings = EvalSettings.from_slices(config.eval, rollout=config.rollout, sglang=config.sglang)
        sources += [(f"{where} {d.name}", d.path, d.input_key, d.label_key, d.metadata_key)
                    for d in settings.datasets]
    return [_check_file(*source, max_line_bytes=rollout.data_max_line_bytes,
                        raw_prompts=custom and (source[0] == "--prompt-data" or not config.eval_fleet_enabled))
            for source in sources]


def _check_file(flag: str, path: str, input_key: str, label_key: str | None, metadata_key: str | None, *,
                max_line_bytes: int, raw_prompts: bool = False) -> str:
    from coordinator.data.check import RecordKeys, check_data_file
    from coordinator.data.source import DataSourceError

    if path.startswith("builtin:"):
        return f"{flag} {path}: a built-in task"
    keys = RecordKeys(input_key=input_key, label_key=label_key, metadata_key=metadata_key, raw_prompts=raw_prompts)
    try:
        count = check_data_file(path, keys, max_line_bytes=max_line_bytes)
    except DataSourceError as error:
        raise ConfigError(f"{flag}: {error}") from None
    named = [f"input key {input_key!r}"] + [f"label key {label_key!r}"] * bool(label_key)
    named += [f"metadata key {metadata_key!r}"] * bool(metadata_key)
    return f"{flag} {path}: all {count} record(s) hold {', '.join(named)}"


def hooks_in_use(config: Config) -> list[tuple[str, str]]:
    """(flag, path) of every hook this run's mode will load."""
    hooks: list[tuple[str, str]] = []
    if config.builds_rollout_fn:  # replay loads no rollout fn, generate function, reward or filter
        rollout, extra = config.rollout, config.hooks
        hooks.append(("--rollout-function-path", rollout.rollout_function_path))
        optional = [("--eval-function-path", rollout.eval_function_path),
                    ("--custom-rm-path", rollout.custom_rm_path),
                    ("--dynamic-sampling-filter-path", rollout.dynamic_sampling_filter_path),
                    ("--custom-reward-post-process-path", rollout.custom_reward_post_process_path),
                    ("--custom-generate-function-path", extra.custom_generate_function_path),
                    ("--generate-tool-specs-path", extra.generate_tool_specs_path),
                    ("--generate-execute-tool-function-path", extra.generate_execute_tool_function_path),
                    ("--custom-agent-function-path", extra.custom_agent_function_path)]
        if extra.use_session_server is not None and extra.session_message_matcher not in ("strict",
                                                                                         "role_content_only"):
            optional.append(("--session-message-matcher", extra.session_message_matcher))
        hooks += [(flag, path) for flag, path in optional if path is not None]
    if config.needs_train_ranks and config.train.custom_tis_function_path is not None:
        hooks.append(("--custom-tis-function-path", config.train.custom_tis_function_path))
    return hooks


def check_hooks(config: Config) -> list[str]:
    """Each hook path imports, names a callable (a class counts: rollout fns may be classes; miles' tool specs
    are a list), and accepts the call rayless makes for its flag, in rayless' form or slime's
    (`coordinator.hooks.forms`)."""
    from workers.hook_loading import HookLoadError, load_object

    notes = []
    for flag, path in hooks_in_use(config):
        try:
            target = load_object(path, what=flag)
        except HookLoadError as error:
            raise ConfigError(str(error)) from None
        if flag != "--generate-tool-specs-path" and not callable(target):
            raise ConfigError(f"{flag} {path!r} names a {type(target).__name__}, not a function or class")
        notes.append(f"{flag} {path}: " + check_hook_signature(flag, path, target, group_rm=config.rollout.group_rm))
    return notes


def check_hook_signature(flag: str, path: str, target: Any, *, group_rm: bool = False) -> str:
    """How the hook will be called, checked against its signature; ConfigError when it cannot be."""
    from coordinator.hooks import forms

    try:
        if flag in ("--rollout-function-path", "--eval-function-path"):
            if inspect.isclass(target):
                return _check_rollout_class(flag, path, target)
            reading = forms.read_rollout_fn(flag, path, target)
        elif flag == "--custom-rm-path":
            reading = forms.read_reward(flag, path, target, group_rm=group_rm)
        elif flag == "--dynamic-sampling-filter-path":
            reading = forms.read_filter(flag, path, target)
        elif flag == "--custom-reward-post-process-path":
            reading = forms.read_reward_post_process(flag, path, target)
        elif flag == "--custom-generate-function-path":
            reading = forms.read_generate(flag, path, target)
        elif flag == "--generate-execute-tool-function-path":
            reading = forms.read_execute_tool(flag, path, target)
        elif flag == "--custom-tis-function-path":
            reading = forms.read_tis(flag, path, target)
        elif flag == "--generate-tool-specs-path":
            return forms.check_tool_specs(flag, path, target)
        elif flag in ("--custom-agent-function-path", "--session-message-matcher"):
            from coordinator.sessions.agentic import check_agent_hook

            return check_agent_hook(flag, path, target)
        else:
            raise KeyError(f"no signature rule for {flag}")
    except forms.HookSignatureError as error:
        raise ConfigError(str(error)) from None
    return f"called as {reading.shown}"


def _check_rollout_class(flag: str, path: str, target: type) -> str:
    """A class: rayless' form (`C(context)` called `(rollout_id, weight_version)`) or miles'
    (`C(RolloutFnConstructorInput)` called `(input)`), read by `forms.read_rollout_class`."""
    from coordinator.hooks import forms

    try:
        return forms.read_rollout_class(flag, path, target).shown
    except forms.HookSignatureError as error:
        raise ConfigError(str(error)) from None


def check_rewards(config: Config) -> list[str]:
    """The rollout's reward type and each eval dataset's can score (IFBench installed for `ifbench`,
    Math-Verify for `math_verify`; every dataset has a reward, a key for a dict-valued one, `--rm-url` for
    `remote_rm`)."""
    from coordinator.rewards.rules import RewardError, require_libraries

    if config.builds_rollout_fn and config.rollout.rm_type is not None:
        try:
            require_libraries(config.rollout.rm_type)
        except RewardError as error:
            raise ConfigError(f"--rm-type {config.rollout.rm_type}: {error}") from None
    if not (config.eval_fleet_enabled or config.rollout_engine_eval_enabled):
        return []
    from coordinator.eval.settings import EvalSettings

    settings = EvalSettings.from_slices(config.eval, rollout=config.rollout, sglang=config.sglang)
    for dataset in settings.datasets:
        try:
            dataset.check()
        except ValueError as error:
            raise ConfigError(str(error)) from None
    return [f"eval dataset {dataset.name}: scored by "
            f"{dataset.reward.custom_rm_path or f'--rm-type {dataset.reward.rm_type}'}" for dataset in settings.datasets]


def check_metric_backends(config: Config) -> list[str]:
    from coordinator.observe.progress import missing_metric_backends

    missing = missing_metric_backends(tensorboard=config.logging.use_tensorboard, wandb=config.logging.use_wandb)
    if missing:
        raise ConfigError("; ".join(missing))
    return []
