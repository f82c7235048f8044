"""What `rayless train --help` prints: rayless' own flags by group, short; the details of a group on request.

Three levels, so the first screen is read rather than scrolled (the full listing is ~930 lines, a third of
them Megatron-LM flags that are accepted and not used):
- `--help`: each group's title and purpose, then the names of its flags; the Megatron-LM group and the other
  upstream flags (accepted and not used, passed to sglang-router, or refused) are one line each.
- `--help WORD`: every flag of the group titled WORD (`--help rollout`), else every flag whose name holds
  WORD (`--help port`), with its meaning, range and default.
- `--help-all`: every flag of every group, upstream ones included (argparse's own full listing).

Invariant: every flag of the parser appears in `--help-all`, and every flag of a rayless group (not the
Megatron-LM slice, not an upstream row) by name in `--help`; nothing here decides what a flag accepts.
"""

from __future__ import annotations

import argparse
import sys
import textwrap
from collections.abc import Sequence
from typing import Any, NoReturn

#: the slice whose flags are accepted and not used (coordinator.config.megatron): behind --help-all
UNUSED_GROUPS = ("Megatron-LM",)
WIDTH = 100


def _own_groups(parser: argparse.ArgumentParser) -> list[Any]:
    """The argument groups of rayless' flags (argparse's positional/options groups and upstream ones left out)."""
    from coordinator.config.flags import SLICES

    titles = {cls.TITLE for _, cls in SLICES} - set(UNUSED_GROUPS)
    return [group for group in parser._action_groups if group.title in titles]


def _flag_names(actions: Sequence[argparse.Action]) -> list[str]:
    """Each flag's long name (`--offload-train` of `--offload-train/--no-offload-train`); hidden ones left out."""
    return [next(option for option in action.option_strings if option.startswith("--")) for action in actions
            if action.option_strings and action.help != argparse.SUPPRESS]


def short_help(parser: argparse.ArgumentParser) -> str:
    """The first screen: usage, then each group's purpose and its flags' names."""
    lines = [parser.format_usage().rstrip(), "", parser.description or "", "",
             "  --config FILE    YAML or TOML file supplying any flag (keys as flag names); the command line wins",
             "  --help WORD      the flags of group WORD (--help rollout), or whose name holds WORD (--help port),",
             "                   each with its meaning, range and default",
             "  --help-all       every flag, the upstream ones accepted and not used (Megatron-LM's) included",
             ""]
    for group in _own_groups(parser):
        lines += textwrap.wrap(f"{group.title}: {group.description or ''}", WIDTH, subsequent_indent="  ")
        lines += textwrap.wrap(" ".join(_flag_names(group._group_actions)), WIDTH, initial_indent="    ",
                               subsequent_indent="    ", break_on_hyphens=False)
    unused = [group for group in parser._action_groups if group.title in UNUSED_GROUPS]
    count = sum(len(_flag_names(group._group_actions)) for group in unused)
    lines.append("")
    lines += textwrap.wrap(f"Megatron-LM: {count} flags of slime/miles launch scripts, accepted and not used "
                           "(--help Megatron-LM). Other slime/miles/sglang-router flags are accepted, passed to "
                           "sglang-router or refused with the reason (docs/porting.md).", WIDTH)
    if parser.epilog:
        lines += textwrap.wrap(parser.epilog, WIDTH)
    return "\n".join(lines) + "\n"


def topic_help(parser: argparse.ArgumentParser, word: str) -> str | None:
    """The full help of the group titled `word`, else of the flags whose name holds `word`; None: neither."""
    groups = [group for group in parser._action_groups if (group.title or "").lower() == word.lower()]
    formatter = parser._get_formatter()
    formatter.add_usage(parser.usage, parser._actions, parser._mutually_exclusive_groups)
    if groups:
        for group in groups:
            formatter.start_section(group.title)
            formatter.add_text(group.description)
            formatter.add_arguments(group._group_actions)
            formatter.end_section()
        return formatter.format_help()
    needle = word.lower().lstrip("-")
    found = [action for action in parser._actions if action.help != argparse.SUPPRESS
             and any(needle in option.lstrip("-") for option in action.option_strings)]
    if not found:
        return None
    formatter.start_section(f"flags whose name holds {needle!r}")
    formatter.add_arguments(found)
    formatter.end_section()
    return formatter.format_help()


def _print_and_exit(parser: argparse.ArgumentParser, text: str) -> NoReturn:
    """Help goes to stdout (argparse's `exit(message=...)` writes to stderr), then exit 0 as argparse's -h."""
    sys.stdout.write(text)
    parser.exit(0)


class HelpAction(argparse.Action):
    """`-h/--help [WORD]`: the short listing, or the details of a group or of matching flags."""

    def __init__(self, option_strings: Sequence[str], dest: str = argparse.SUPPRESS, **kwargs: Any) -> None:
        super().__init__(option_strings, dest=dest, default=argparse.SUPPRESS, nargs="?", metavar="WORD",
                         help="this short listing; --help WORD: the flags of group WORD, or whose name holds WORD")

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> NoReturn:
        if values is None:
            _print_and_exit(parser, short_help(parser))
        text = topic_help(parser, str(values))
        if text is None:
            titles = ", ".join(group.title for group in _own_groups(parser))
            parser.error(f"--help {values}: no group of that name and no flag whose name holds it; "
                         f"the groups: {titles}, {', '.join(UNUSED_GROUPS)}")
        _print_and_exit(parser, text)


class HelpAllAction(argparse.Action):
    """`--help-all`: argparse's listing of every flag."""

    def __init__(self, option_strings: Sequence[str], dest: str = argparse.SUPPRESS, **kwargs: Any) -> None:
        super().__init__(option_strings, dest=dest, default=argparse.SUPPRESS, nargs=0,
                         help="every flag, upstream ones accepted and not used included")

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> NoReturn:
        _print_and_exit(parser, parser.format_help())
