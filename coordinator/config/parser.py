"""From a command line and an optional `--config` file to a validated Config.

Owns the argparse parser, generated from the slices' fields (one group per slice in `--help-all`; the short
`--help` is `coordinator.config.help`), the reading of YAML/TOML config files, the `--sglang-*` passthrough (and
miles' `--eval-sglang-*` overrides), and `parse_config`, the one parsing path.

Invariants:
- argparse only splits the command line into flags and strings (no `type=`, no `choices=`, no defaults:
  `SUPPRESS`); every value, from the command line or a file, then goes through `fields.convert`, so both
  meet the same types, choices and ranges, and a default, a file value and a command-line value can be told
  apart. The command line wins over the file.
- Every parse failure is a `ConfigError` (exit status 2 in the CLI): argparse's own errors included, without
  its usage dump. Flags are never abbreviated (`allow_abbrev=False`).
- Importing this module imports neither torch nor transformers.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn

from coordinator.config.fields import ConfigError, FlagSpec, convert, flag_name
from coordinator.config.flags import FLAGS, SLICES
from coordinator.config.help import HelpAction, HelpAllAction
from coordinator.config.rules import validate
from coordinator.config.settings import Config, build_config
from coordinator.config.unknown import closest_flag, unknown_flags_report
from coordinator.config.upstream_args import add_upstream_arguments, take_upstream
from coordinator.config.yaml_files import load_config_yaml

_METAVARS = {int: "N", float: "X", str: "VALUE"}


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise ConfigError(message)


def _help_text(spec: FlagSpec) -> str:
    """The field's help, then its range and default (a secret's default is never shown)."""
    notes = [spec.range_text()]
    default = spec.default
    if isinstance(default, frozenset):
        notes.append(f"default: {','.join(sorted(default))}")
    elif default not in (None, ()) and not isinstance(default, bool) and not spec.secret:
        notes.append(f"default: {default}")
    notes = [note for note in notes if note]
    return spec.options.help + (f" ({'; '.join(notes)})" if notes else "")


def build_parser(prog: str = "rayless train") -> argparse.ArgumentParser:
    parser = _Parser(
        prog=prog,
        usage="%(prog)s [--config FILE] [FLAG ...]",
        description="Run RL post-training: rollouts on SGLang-compatible engines, training on torchrun ranks.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Unknown --sglang-* flags are passed to sglang.launch_server with the prefix removed.",
        allow_abbrev=False,
        add_help=False,  # ours: a short --help, --help WORD, --help-all (coordinator.config.help)
    )
    parser.add_argument("-h", "--help", action=HelpAction)
    parser.add_argument("--help-all", action=HelpAllAction)
    parser.add_argument("--config", dest="config_file", default=argparse.SUPPRESS, metavar="FILE",
                        help="YAML or TOML file supplying any flag (keys as flag names); the command line wins")
    for _, cls in SLICES:
        group = parser.add_argument_group(cls.TITLE, cls.DESCRIPTION)
        for spec in cls.specs():
            if spec.kind is bool and spec.container is None:
                # `bool | None` (unset: a default decided by other flags) also takes slime's `--no-<flag>`
                action = argparse.BooleanOptionalAction if spec.optional else "store_true"
                group.add_argument(spec.flag, dest=spec.name, action=action, default=argparse.SUPPRESS,
                                   help=_help_text(spec))
                continue
            choices = spec.choices()
            metavar = spec.options.metavar or ("{" + ",".join(map(str, choices)) + "}" if choices
                                               else _METAVARS[spec.kind])
            if spec.options.bare is not None:  # `--flag` alone means `--flag BARE`
                group.add_argument(spec.flag, dest=spec.name, default=argparse.SUPPRESS, metavar=metavar,
                                   nargs="?", const=spec.options.bare, help=_help_text(spec))
                continue
            group.add_argument(spec.flag, dest=spec.name, default=argparse.SUPPRESS, metavar=metavar,
                               nargs="+" if spec.container is not None else None, help=_help_text(spec))
    add_upstream_arguments(parser, set(known_flags()))
    return parser


def parse_config(argv: Sequence[str] | None = None, *, prog: str = "rayless train") -> Config:
    """Parse and validate a command line. Raises ConfigError (the CLI maps it to exit status 2)."""
    parser = build_parser(prog)
    from coordinator.config.upstream import rename_retired_flags

    arguments, renamed = rename_retired_flags(list(sys.argv[1:] if argv is None else argv))
    args, unknown = parser.parse_known_args(arguments)
    eval_passthrough, unknown = split_eval_sglang_passthrough(unknown)
    passthrough, rest = split_sglang_passthrough(unknown)
    given, upstream = take_upstream(vars(args))
    problems = [upstream.refusal(), unknown_flags_report(rest, known_flags()) if rest else None]
    if any(problems):
        raise ConfigError("\n".join(problem for problem in problems if problem))
    config_file = given.pop("config_file", None)
    values: dict[str, Any] = {}
    if config_file is not None:
        values.update(read_config_file(config_file))
    for name, raw in given.items():
        values[name] = convert(FLAGS[name][1], raw, FLAGS[name][1].flag)
    names = frozenset(values)
    attributes: dict[str, Any] = {}
    if values.get("custom_config_path") is not None:
        values, attributes = apply_custom_config(values, values["custom_config_path"])
    if values.get("megatron_config_path") is not None:  # slime: each role's YAML overrides the shared flags
        from coordinator.config.megatron_roles import apply_megatron_config

        before = dict(values)
        values = apply_megatron_config(values, values["megatron_config_path"])[0]
        names |= {name for name in values if name not in before or values[name] != before[name]}
    if values.get("load_debug_rollout_data") is not None:  # a replay trains with its dumps' flags by default
        from coordinator.config.replayed import replay_values

        values = replay_values(values, frozenset(values))
    config = build_config(values, config_file=config_file, sglang_passthrough=tuple(passthrough), given=names,
                          eval_sglang_passthrough=tuple(eval_passthrough),
                          custom_attributes=tuple(attributes.items()), upstream_ignored=upstream.ignored,
                          router_passthrough=upstream.router_args, renamed_flags=renamed)
    validate(config)
    return config


def apply_custom_config(values: dict[str, Any], path: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """slime's `--custom-config-path`: a YAML mapping whose keys are set on `args` after the flags. A key naming
    one of our flags sets that flag (its value meets the flag's checks; a warning says when it overrides a value
    given on the command line or in `--config`); any other key is returned as an attribute for hooks' args."""
    import warnings

    from coordinator.config.fields import ConfigWarning

    origin = f"--custom-config-path {path}"
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"{origin}: no such file")
    try:
        data = _load_yaml(file.read_bytes(), path, "--custom-config-path")
    except OSError as error:
        raise ConfigError(f"{origin}: cannot be read: {error}") from None
    if not isinstance(data, dict) or not all(isinstance(key, str) and key.isidentifier() for key in data):
        raise ConfigError(f"{origin}: the top level must be a mapping of argument names (identifiers) to values")
    values = dict(values)
    attributes: dict[str, Any] = {}
    for key, value in data.items():
        name = key.replace("-", "_")
        if name in FLAGS and name != "custom_config_path":
            converted = file_value(FLAGS[name][1], value, f"{origin}: key {key!r}")
            if name in values and values[name] != converted:
                warnings.warn(f"{origin}: {key} = {value!r} overrides {FLAGS[name][1].flag} (as slime, the file "
                              "wins)", ConfigWarning, stacklevel=2)
            values[name] = converted
        else:
            attributes[name] = value
    return values, attributes


def parse_config_mapping(data: Mapping[Any, Any], *, origin: str = "config") -> Config:
    """Validate a mapping of flag names to values as a `--config` file's contents (no command line)."""
    config = build_config(config_file_values(data, origin=origin))
    validate(config)
    return config


def config_from_mapping(values: Mapping[str, Any]) -> Config:
    """A Config from field names → raw values, each converted (types, choices, ranges), not cross-validated."""
    converted = {}
    for name, raw in values.items():
        if name not in FLAGS:
            raise ConfigError(f"unknown flag {name!r}")
        converted[name] = convert(FLAGS[name][1], raw, FLAGS[name][1].flag)
    return build_config(converted)


def known_flags() -> list[str]:
    negated = ["--no-" + spec.flag[2:] for _, spec in FLAGS.values()
               if spec.kind is bool and spec.optional and spec.container is None]
    return ["--config", *(spec.flag for _, spec in FLAGS.values()), *negated]


def read_config_file(path: str) -> dict[str, Any]:
    """The flags a YAML or TOML file supplies, converted; ConfigError naming the file (and key) otherwise."""
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"--config {path}: no such file")
    if file.suffix not in (".toml", ".yaml", ".yml"):
        raise ConfigError(f"--config {path}: expected a .yaml, .yml or .toml file")
    from workers.boundary.yaml_input import MAX_YAML_BYTES

    try:
        if file.stat().st_size > MAX_YAML_BYTES:
            raise ConfigError(f"--config {path}: larger than {MAX_YAML_BYTES} bytes; a config file is small text")
        text = file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(f"--config {path}: cannot be read: {error}") from None
    data = _load_toml(text, path) if file.suffix == ".toml" else _load_yaml(text, path)
    return config_file_values(data, origin=f"--config {path}")


def _load_toml(text: str, path: str) -> Any:
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # Python 3.10
        import tomli as tomllib
    try:
        return tomllib.loads(text)
    except (tomllib.TOMLDecodeError, RecursionError) as error:
        raise ConfigError(f"--config {path}: not valid TOML: {error}") from None


def _load_yaml(text: str | bytes, path: str, flag: str = "--config") -> Any:
    data = load_config_yaml(text, f"{flag} {path}")
    return {} if data is None else data


def file_value(spec: FlagSpec, raw: Any, where: str) -> Any:
    """A config file's value for one flag: null is no value for a flag taking a number or text (the command
    line cannot give one either), so it is refused rather than left for later code to trip on."""
    if raw is None and spec.container is None and spec.kind in (int, float, str):
        raise ConfigError(f"{where}: null is not a value for {spec.flag} (it takes {_kind_text(spec)}); "
                          "omit the key to keep the default")
    return convert(spec, raw, where)


def _kind_text(spec: FlagSpec) -> str:
    return {int: "an integer", float: "a number", str: "text"}[spec.kind]


def config_file_values(data: Any, *, origin: str) -> dict[str, Any]:
    """A file's top-level mapping (keys as flag names, with or without dashes) as converted field values."""
    if not isinstance(data, dict):
        raise ConfigError(f"{origin}: the top level must be a mapping of flag names to values")
    result: dict[str, Any] = {}
    keys: dict[str, Any] = {}
    for key, value in data.items():
        name = str(key).lstrip("-").replace("-", "_") if isinstance(key, str) else None
        if name is None or name not in FLAGS:
            suggestion = closest_flag(flag_name(str(key).lstrip("-")), known_flags()) if isinstance(key, str) else None
            hint = f" (did you mean {suggestion.lstrip('-')!r}?)" if suggestion else ""
            raise ConfigError(f"{origin}: unknown flag {_key_text(key)}{hint}")
        if name in keys:
            raise ConfigError(f"{origin}: {_key_text(keys[name])} and {_key_text(key)} set the same flag")
        keys[name] = key
        result[name] = file_value(FLAGS[name][1], value, f"{origin}: key {_key_text(key)}")
    return result


def _key_text(key: Any) -> str:
    text = repr(key)
    return text if len(text) <= 60 else text[:57] + "..."


def split_eval_sglang_passthrough(unknown: list[str]) -> tuple[list[str], list[str]]:
    """miles' eval-fleet overrides: `--eval-sglang-mem-fraction-static 0.9` → `--mem-fraction-static 0.9`, and
    `--no-eval-sglang-X` (miles' BooleanOptionalAction) → `--no-X`, which drops an inherited `--X`."""
    overrides: list[str] = []
    rest: list[str] = []
    taking = False
    for token in unknown:
        for prefix, replacement in (("--eval-sglang-", "--"), ("--no-eval-sglang-", "--no-")):
            if token.startswith(prefix):
                overrides.append(replacement + token[len(prefix):])
                taking = replacement == "--"
                break
        else:
            if token.startswith("-"):
                rest.append(token)
                taking = False
            elif taking:
                overrides.append(token)
            else:
                rest.append(token)
    return overrides, rest


def split_sglang_passthrough(unknown: list[str]) -> tuple[list[str], list[str]]:
    """`--sglang-mem-fraction-static 0.8` → `--mem-fraction-static 0.8` for sglang.launch_server."""
    passthrough: list[str] = []
    rest: list[str] = []
    taking = False
    for token in unknown:
        if token.startswith("--sglang-"):
            passthrough.append("--" + token[len("--sglang-"):])
            taking = True
        elif token.startswith("-"):
            rest.append(token)
            taking = False
        elif taking:
            passthrough.append(token)
        else:
            rest.append(token)
    return passthrough, rest
