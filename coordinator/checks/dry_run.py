"""`rayless train --dry-run`: every start-up check that does not need the GPUs, then the placement plan.

Owns the dry run's report. It runs each check of `checks.preflight` (paths, data keys, hooks and their
signatures, checkpoint and run directories, metric backends, response length against the context, the ports the
flags fix, a replay's dumps) and loads the tokenizer (rendering the first prompt with `--apply-chat-template`),
collecting every failure rather than stopping at the first, then prints the
plan a launch on this node would follow (`coordinator.plan`, built leniently: too few GPUs here, or no
`sglang` package on a login node, are warnings).

Invariants: nothing is launched, no port stays open and no file is written (the run directory included);
the exit status is 0 when every check passed (warnings allowed) and 2 otherwise; no secret is printed.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from coordinator.config.fields import ConfigError
from coordinator.config.settings import Config

if TYPE_CHECKING:
    from coordinator.plan.layout import NodeLayout

PROMPT_CHARS = 400


def dry_run(config: Config, *, mask: Callable[[str], str], out: TextIO | None = None,
            err: TextIO | None = None, layout: NodeLayout | None = None,
            layout_warnings: Sequence[str] = ()) -> int:
    """The report; `layout` / `layout_warnings`: a multi-node run's node layout, as `resolve_layout` found it
    (the plan printed is this node's share)."""
    from coordinator.checks.preflight import (
        check_checkpoints,
        check_data,
        check_hooks,
        check_metric_backends,
        check_paths,
        check_ports,
        check_replay,
        check_response_length,
    )
    from coordinator.config.porting import porting_notice
    from coordinator.plan import describe_plan, plan_for_dry_run

    out = out or sys.stdout
    err = err or sys.stderr
    notes: list[str] = []
    errors: list[str] = []
    load = None

    def checkpoints(config: Config) -> list[str]:
        nonlocal load
        found, load = check_checkpoints(config)
        return found

    from coordinator.checks.trainable import check_trainable

    def trainable(config: Config) -> list[str]:
        return check_trainable(config, always=True)

    from coordinator.checks.run_dir import check_run_dir

    for check in (check_paths, checkpoints, check_run_dir, check_data, check_tokenizer, check_hooks,
                  check_metric_backends, check_response_length, check_ports, trainable, check_replay):
        try:
            notes += check(config)
        except ConfigError as error:
            if str(error) not in errors:  # two checks reading the same flag (--load) find the same fault
                errors.append(str(error))
    if load is not None:
        notice = porting_notice(config, load=load)
        if notice is not None:
            print(mask(f"rayless train: notice: {notice}"), file=err)
    plan = None
    try:
        plan = plan_for_dry_run(config, layout, layout_warnings)
    except ConfigError as error:
        errors.append(str(error))
    print("rayless train --dry-run: checks (nothing is launched)", file=out)
    for note in notes:
        print(mask("  ok  " + note.replace("\n", "\n      ")), file=out)
    if plan is not None:
        print("", file=out)
        print(mask(describe_plan(plan)), file=out)
        for warning in plan.warnings:
            print(mask(f"rayless train: warning: {warning}"), file=err)
    for error in errors:
        print(mask(f"rayless train: error: {error}"), file=err)
    print("", file=out)
    print("dry run: " + (f"{len(errors)} problem(s), see above" if errors else "every check passed")
          + "; nothing was launched", file=out)
    return 2 if errors else 0


def check_tokenizer(config: Config) -> list[str]:
    """The tokenizer loads from `--hf-checkpoint`; with `--apply-chat-template` the first prompt renders."""
    if not (Path(str(config.rollout.hf_checkpoint)) / "config.json").is_file():
        return []  # check_paths says what is wrong with the directory
    try:
        from coordinator.data.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(config.rollout.hf_checkpoint, local_files_only=True)
    except Exception as error:  # transformers raises many types for a bad directory
        raise ConfigError(f"--hf-checkpoint {config.rollout.hf_checkpoint}: the tokenizer does not load: "
                          f"{type(error).__name__}: {error}") from None
    notes = [f"tokenizer: {type(tokenizer).__name__}, {len(tokenizer)} tokens"]
    rollout = config.rollout
    if rollout.apply_chat_template and rollout.prompt_data and config.builds_rollout_fn:
        from coordinator.rollout.chat_kwargs import with_chat_template_kwargs

        prompt = _first_prompt(config, with_chat_template_kwargs(tokenizer, config.rollout.chat_template_kwargs))
        if prompt is None:
            return notes  # check_data reports what is wrong with the file
        shown = prompt if len(prompt) <= PROMPT_CHARS else prompt[:PROMPT_CHARS] + "..."
        shown = shown.rstrip("\n") + ("⏎" if shown.endswith("\n") else "")  # a trailing newline, visible
        notes.append(f"--apply-chat-template: the first prompt renders as:\n{shown}")
    return notes


def _first_prompt(config: Config, tokenizer: object) -> str | None:
    from coordinator.data.source import DataSourceError, PromptDataSource, read_prompt_file
    from coordinator.data.tasks import builtin_task_name, make_task_prompts

    rollout = config.rollout
    prompt_data = str(rollout.prompt_data)
    task = builtin_task_name(prompt_data)
    try:
        records = (make_task_prompts(task, 1, rollout.rollout_seed) if task is not None else
                   read_prompt_file(prompt_data, input_key=rollout.input_key, label_key=rollout.label_key,
                                    metadata_key=rollout.metadata_key, limit=1))
    except DataSourceError:
        return None
    try:
        source = PromptDataSource.from_records(records, apply_chat_template=True, tokenizer=tokenizer,  # type: ignore[arg-type]
                                               shuffle=False, seed=0, source=prompt_data)
        prompt = source.take(1)[0].prompt
    except DataSourceError as error:
        raise ConfigError(f"--apply-chat-template: {error}") from None
    return str(prompt)
