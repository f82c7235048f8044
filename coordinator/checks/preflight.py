"""Start-up checks against the machine: files that must exist, data that must hold the keys asked for, hooks
that must import and accept the calls they will get, checkpoint and run directories, backends installed.

Owns `preflight(config)`, run by `rayless train` after the flags parse and before any process is launched or
port opened (and by `--dry-run`, which reports every check's outcome). Invariant: every failure is a
`ConfigError` naming the flag (exit status 2). Hooks are resolved here (their modules imported, the attribute
found, callable with the arguments rayless passes), not when the rollout manager is built after engines and
ranks started. Only what the run's mode uses is checked. Each check returns short notes of what it found,
for `--dry-run` to print; the last step warns the grouped `PortingNotice` about flags from slime/miles scripts.
"""

from __future__ import annotations

import functools
import inspect
import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from coordinator.config.checkpoint import LoadPlan, save_hf_path
from coordinator.config.fields import ConfigError
from coordinator.config.porting import PortingNotice, porting_notice
from coordinator.config.settings import Config
from coordinator.data.chats import TemplateForms


def preflight(config: Config) -> list[str]:
    """Every check; the notes of what was found (`--dry-run` prints them)."""
    notes = [*check_paths(config)]
    load_notes, load = check_checkpoints(config)
    from coordinator.checks.disk import check_disk
    from coordinator.checks.run_dir import check_run_dir

    load_notes += check_disk(config)  # every file a rank or engine will read, before either starts
    notes += [*load_notes, *check_run_dir(config), *check_data(config), *check_hooks(config),
              *check_rewards(config), *check_metric_backends(config), *check_response_length(config),
              *check_ports(config), *check_replay(config)]
    from coordinator.checks.trainable import check_trainable

    notes += check_trainable(config)  # with LoRA: the targets against the model
    notice = porting_notice(config, load=load)
    if notice is not None:
        warnings.warn(notice, PortingNotice, stacklevel=2)
    return notes


def _fixed_ports(config: Config) -> list[tuple[str, str, int, str]]:
    """(flag as shown, host, port, what listens there) of every port this node binds at a number the flags
    fix. Engines, the router and the weight-sync groups take free ports (moving off a taken one), so only
    these can be taken; on a node other than node 0 the control channel and the registry are dialled, not
    bound."""
    cluster, ports = config.cluster, []
    coordinator_node = cluster.actor_node_rank == 0
    if coordinator_node and config.needs_train_ranks and cluster.control_port:
        ports.append((f"--control-port {cluster.control_port}", cluster.control_host, cluster.control_port,
                      "the control channel"))
    if coordinator_node and cluster.actor_num_nodes > 1 and cluster.control_port:
        registry = cluster.control_port + 1
        ports.append((f"--control-port {cluster.control_port} (+1, the node registry)", cluster.control_host,
                      registry, "the node registry"))
    hooks = config.hooks
    if hooks.use_session_server is not None and config.needs_engines and hooks.session_server_port \
            and hooks.session_server_port[0]:
        port = hooks.session_server_port[0]
        ports.append((f"--session-server-port {port}", hooks.session_server_ip, port, "the session server"))
    settings = config.logging
    if settings.status_port:
        ports.append((f"--status-port {settings.status_port}", settings.status_host, settings.status_port,
                      "the status page"))
    return ports


def check_ports(config: Config) -> list[str]:
    """Every port the flags fix is free on its host now, before anything is launched (each is bound again
    when its server starts; a port taken in between is still reported then, naming the flag)."""
    from coordinator.engines.spec import port_is_free

    notes = []
    for shown, host, port, what in _fixed_ports(config):
        where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        if ":" not in host and not port_is_free(host, port):  # IPv6 hosts: checked when bound
            raise ConfigError(f"{shown}: {where} is in use or cannot be bound (for {what}); give another port"
                              + (" (0: any free port)" if shown.startswith("--control-port") and
                                 config.cluster.actor_num_nodes == 1 else ""))
        notes.append(f"{shown}: {what} at " + (f"http://{where}" if what == "the status page" else where))
    return notes


def check_response_length(config: Config) -> list[str]:
    """A `--rollout-max-response-len` (or `--eval-max-response-len`) given that no response can reach: above the
    engines' context (`--sglang-context-length`, else the model's `max_position_embeddings`) less the shortest
    prompt, one token. slime clips every request to what the context leaves, silently; here a length that
    would always be clipped is refused with the choices, unless `--rollout-max-context-len` (slime's cap on
    prompt + response, which eval shares) says that clipping is meant. The default (1024) is only noted: it is
    no one's choice."""
    from coordinator.config.porting import model_context_length

    context, source = model_context_length(config)
    if context is None:
        return []
    room = context - 1  # a prompt has at least one token
    cap = config.rollout.rollout_max_context_len
    lengths = [("--rollout-max-response-len", config.rollout.rollout_max_response_len,
                "rollout_max_response_len" in config.given)]
    if config.eval.eval_max_response_len is not None:
        lengths.append(("--eval-max-response-len", config.eval.eval_max_response_len, True))
    notes = []
    for flag, length, given in lengths:
        if length <= room:
            notes.append(f"{flag} {length}: fits the context of {context} tokens ({source}) beside a prompt of up "
                         f"to {context - length} tokens; a longer prompt leaves its response less room")
        elif cap is not None and cap <= context:
            notes.append(f"{flag} {length}: each prompt + response is capped at --rollout-max-context-len {cap}")
        elif given:
            raise ConfigError(
                f"{flag} {length}: no response can be that long: the context is {context} tokens ({source}) and a "
                f"prompt takes at least 1, so every response would be cut at {room} tokens or fewer. Choose: "
                f"{flag} {room} or less (a response of R tokens then fits beside a prompt of up to {context} - R); "
                "a longer context, --sglang-context-length N (when the model's positions allow it); or "
                f"--rollout-max-context-len {context} to cap each prompt + response there, as slime clips")
        else:
            notes.append(f"{flag} {length} (the default): longer than the context of {context} tokens "
                         f"({source}); each response is bounded by what the context leaves beside its prompt")
    return notes


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
    if load.resume and load.run_dir is not None:
        notes.append(f"--load {load.run_dir}: a run directory; resumes from the checkpoint its run saved in "
                     f"{load.path}")
    elif load.resume:
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


def check_replay(config: Config) -> list[str]:
    """A replay's dumps, found before anything launches: at least one dump the template matches; the ids found,
    and those of the rollouts to replay that have none."""
    template = config.debug.load_debug_rollout_data
    if template is None or config.cluster.actor_node_rank != 0:  # node 0's coordinator is what reads them
        return []
    from coordinator.rollout.epochs import replayed_rollout_ids

    ids = replayed_rollout_ids(template)
    note = f"--load-debug-rollout-data {template}: {len(ids)} dump(s), rollout ids {ids[0]}..{ids[-1]}"
    wanted = config.rollout.num_rollout
    missing = sorted(set(range(wanted)) - set(ids)) if wanted is not None else []
    if missing:
        note += (f"; no dump for {len(missing)} of the {wanted} rollouts (the first: {missing[0]}): a run "
                 "replaying them stops there")
    return [note]


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
    # SFT renders every chat with the model's template; the rollout and eval when asked to
    templated = config.sft.enabled or rollout.apply_chat_template
    forms = functools.cache(lambda: _template_forms(rollout.hf_checkpoint)) if templated else None
    return [_check_file(*source, max_line_bytes=rollout.data_max_line_bytes,
                        raw_prompts=custom and (source[0] == "--prompt-data" or not config.eval_fleet_enabled),
                        template_forms=forms,
                        multimodal_keys=rollout.multimodal_key_map)
            for source in sources]


def _template_forms(checkpoint: str | None) -> TemplateForms:
    """What `--hf-checkpoint`'s chat template renders of content parts and null contents (not known when its
    tokenizer does not load here: the run then says so itself)."""
    from coordinator.data.chats import UNKNOWN, template_forms

    if checkpoint is None:
        return UNKNOWN
    try:
        from coordinator.data.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(checkpoint, local_files_only=True)
    except (OSError, ValueError):
        return UNKNOWN
    return template_forms(tokenizer)


def _check_file(flag: str, path: str, input_key: str, label_key: str | None, metadata_key: str | None, *,
                max_line_bytes: int, raw_prompts: bool = False,
                template_forms: Callable[[], TemplateForms] | None = None,
                multimodal_keys: dict[str, str] | None = None) -> str:
    from coordinator.data.check import RecordKeys, check_data_file
    from coordinator.data.source import DataSourceError

    if path.startswith("builtin:"):
        return f"{flag} {path}: a built-in task"
    keys = RecordKeys(input_key=input_key, label_key=label_key, metadata_key=metadata_key, raw_prompts=raw_prompts,
                      multimodal_keys=multimodal_keys)
    try:
        count = check_data_file(path, keys, max_line_bytes=max_line_bytes,
                                template_forms=None if raw_prompts else template_forms)
    except DataSourceError as error:
        raise ConfigError(f"{flag}: {error}") from None
    named = [f"input key {input_key!r}"] + [f"label key {label_key!r}"] * bool(label_key)
    named += [f"metadata key {metadata_key!r}"] * bool(metadata_key)
    if multimodal_keys:
        named.append(f"images of {multimodal_keys['image']!r}, decoded within bounds")
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
        if flag == "--eval-function-path":
            from coordinator.config.eval_rules import checkpoint_eval_fn_fits, eval_fleet_flags_need_a_fleet
            from coordinator.hooks.checkpoint_eval import is_checkpoint_eval_fn

            if is_checkpoint_eval_fn(target):  # miles' CheckpointEvalFn: evaluates snapshot directories
                checkpoint_eval_fn_fits(config)
            else:  # the snapshot flags the parse let through for it have no effect after all
                eval_fleet_flags_need_a_fleet(config, checkpoint_eval_fn=False)
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
