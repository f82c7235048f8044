"""Declaring a flag once, beside its field, and the one converter every value goes through.

Owns `flag(...)` (a dataclass field whose metadata holds the help text, choices, numeric range and secrecy),
`FlagSpec` (that declaration resolved against the field's type), `convert` (the only way a raw value — a
command-line string, or any YAML/TOML value of a `--config` file — becomes a field value) and the `Slice`
base class (each slice re-checks its declared ranges and adds its own rules in `check`).

Invariants:
- A value reaches a Config only through `convert`: the same types, choices and ranges whatever its origin.
- `convert` and `Slice.validate` raise only `ConfigError`, whose message names where the value came from (the
  flag, or the file and key); a secret's value never appears in a message.
- Every int is bounded (at most `INT64_MAX` unless the field says less) and every float is finite unless the
  field says `finite=False`: values travel to engines and ranks, which cannot hold more.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from workers.errors import RaylessError

INT64_MAX = 2**63 - 1
_SECRET_WORDS = frozenset({"secret", "password", "passwd", "credential", "credentials", "apikey"})


class ConfigError(RaylessError, ValueError):
    """Flags that contradict each other, are incomplete, or hold a value of the wrong type or range. The
    message names the flags (or the `--config` file and key); the CLI turns it into exit status 2."""


class ConfigWarning(UserWarning):
    """A flag that has no effect in this configuration (as miles warns, rather than fails)."""


def looks_secret(name: str) -> bool:
    """A flag or field name whose value must never be shown: `*_key`, `*_token`, or one naming a secret.

    Fields named `*_key` that name a data column (`--input-key`) declare `secret=False` themselves.
    """
    words = name.lstrip("-").replace("-", "_").lower().split("_")
    return words[-1] in ("key", "token") or bool(_SECRET_WORDS.intersection(words))


def flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


@dataclass(frozen=True)
class FlagOptions:
    """What `flag()` records beside a field. See `flag` for the meaning of each option."""

    help: str
    choices: tuple[Any, ...] | Callable[[], Sequence[Any]] | None = None
    minimum: float | None = None
    above: float | None = None
    maximum: float | None = None
    also: tuple[Any, ...] = ()
    finite: bool = True
    secret: bool | None = None
    parse: Callable[[str], str] | None = None
    split_commas: bool = False
    metavar: str | None = None
    bare: str | None = None


def flag(
    default: Any,
    *,
    help: str,
    choices: tuple[Any, ...] | Callable[[], Sequence[Any]] | None = None,
    minimum: float | None = None,
    above: float | None = None,
    maximum: float | None = None,
    also: tuple[Any, ...] = (),
    finite: bool = True,
    secret: bool | None = None,
    parse: Callable[[str], str] | None = None,
    split_commas: bool = False,
    metavar: str | None = None,
    bare: str | None = None,
) -> Any:
    """A slice field that is also a command-line flag named after it (`rollout_batch_size` → `--rollout-batch-size`).

    help: the `--help` text (the default and the range are appended); choices: the allowed values, or a
    function returning them (read when a value is checked, so a registry elsewhere stays the one list);
    minimum / maximum: inclusive bounds; above: an exclusive lower bound; also: values allowed outside the
    bounds (e.g. -1 = off); finite: floats reject nan and ±inf; secret: never shown (default: by name, see
    `looks_secret`); parse: a check of each string value (addresses, hook paths) that raises ValueError with a
    reason; split_commas: `a,b c` gives three items (`--ft-components`); bare: the value of the flag given
    without one (miles' `--use-session-server` alone means `v1`).
    """
    options = FlagOptions(help=help, choices=choices, minimum=minimum, above=above, maximum=maximum, also=also,
                          finite=finite, secret=secret, parse=parse, split_commas=split_commas, metavar=metavar,
                          bare=bare)
    return dataclasses.field(default=default, metadata={"flag": options})


@dataclass(frozen=True)
class FlagSpec:
    """One flag, resolved: its field, base type (`kind`), whether None is allowed, and its container."""

    name: str
    slice_name: str
    kind: type
    optional: bool
    container: type | None  # tuple or frozenset for flags taking several values
    default: Any
    options: FlagOptions

    @property
    def flag(self) -> str:
        return flag_name(self.name)

    @property
    def secret(self) -> bool:
        return self.options.secret if self.options.secret is not None else looks_secret(self.name)

    def choices(self) -> tuple[Any, ...] | None:
        choices = self.options.choices
        if choices is None:
            return None
        return tuple(choices() if callable(choices) else choices)

    def range_text(self) -> str:
        """`≥ 1`, `in (0, 1]`, `≥ 1 or -1`; empty when the field declares no bound."""
        options = self.options
        high = options.maximum if options.maximum is not None and options.maximum < INT64_MAX else None
        if options.above is not None:
            text = f"in ({options.above:g}, {high:g}]" if high is not None else f"> {options.above:g}"
        elif options.minimum is not None:
            text = f"in [{options.minimum:g}, {high:g}]" if high is not None else f"≥ {options.minimum:g}"
        else:
            text = f"≤ {high:g}" if high is not None else ""
        if text and options.also:
            text += " or " + " or ".join(str(value) for value in options.also)
        return text


def resolve_specs(cls: type, slice_name: str) -> tuple[FlagSpec, ...]:
    """The FlagSpecs of a slice dataclass, in declaration order (fields without `flag()` are not flags)."""
    hints = typing.get_type_hints(cls)
    specs = []
    for field in dataclasses.fields(cls):
        options = field.metadata.get("flag")
        if options is None:
            continue
        kind, optional, container = _unpack_type(hints[field.name])
        specs.append(FlagSpec(name=field.name, slice_name=slice_name, kind=kind, optional=optional,
                              container=container, default=field.default, options=options))
    return tuple(specs)


def _unpack_type(hint: Any) -> tuple[type, bool, type | None]:
    optional = False
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        members = [arg for arg in typing.get_args(hint) if arg is not type(None)]
        optional = len(members) < len(typing.get_args(hint))
        (hint,) = members
    container = typing.get_origin(hint)
    if container in (tuple, frozenset):
        return typing.get_args(hint)[0], optional, container
    return hint, optional, None


# ----------------------------------------------------------------------------------------------------------
# Conversion: one path for command-line strings and config-file values
# ----------------------------------------------------------------------------------------------------------
def _shown(spec: FlagSpec, value: Any) -> str:
    if spec.secret:
        return "'***'"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def convert(spec: FlagSpec, raw: Any, where: str) -> Any:
    """`raw` (a command-line string or list of strings, or any YAML/TOML value) as this field's value.

    `where` names the origin in messages: the flag, or "--config FILE: key 'KEY'".
    """
    if raw is None:
        if spec.optional:
            return None
        raise ConfigError(f"{where}: a value is required, got null")
    if spec.container is None:
        if isinstance(raw, list | tuple | set | frozenset | dict):
            raise ConfigError(f"{where}: expected one value, got {type(raw).__name__} {_shown(spec, raw)}")
        return check_value(spec, _convert_one(spec, raw, where), where)
    items = list(raw) if isinstance(raw, list | tuple) else [raw]
    if spec.options.split_commas:
        items = [part.strip() if isinstance(item, str) else part
                 for item in items for part in (item.split(",") if isinstance(item, str) else [item])]
        items = [item for item in items if item != ""]
    return spec.container(check_value(spec, _convert_one(spec, item, where), where) for item in items)


def _convert_one(spec: FlagSpec, raw: Any, where: str) -> Any:
    kind = spec.kind
    expected = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}[kind]
    failure = ConfigError(f"{where}: expected {expected}, got {type(raw).__name__} {_shown(spec, raw)}")
    if kind is bool:
        if isinstance(raw, bool):
            return raw
        raise failure
    if kind is str:
        if not isinstance(raw, str):
            raise failure
        return raw
    if isinstance(raw, bool) or not isinstance(raw, int | float | str):
        raise failure
    try:
        if kind is int:
            if isinstance(raw, float):
                if not raw.is_integer():
                    raise failure
                return int(raw)
            return int(raw.strip()) if isinstance(raw, str) else int(raw)
        return float(raw.strip()) if isinstance(raw, str) else float(raw)
    except (ValueError, OverflowError):
        raise failure from None


def check_value(spec: FlagSpec, value: Any, where: str) -> Any:
    """The declared choices and range of one (converted) value; ConfigError naming `where` otherwise."""
    choices = spec.choices()
    if choices is not None and value not in choices:
        shown = _shown(spec, value)
        raise ConfigError(f"{where}: {shown} is not a valid choice; choose from {', '.join(map(str, choices))}")
    if spec.kind is str and spec.options.parse is not None:
        try:
            return spec.options.parse(value)
        except ValueError as error:
            raise ConfigError(f"{where}: {_shown(spec, value)} {error}") from None
    if spec.kind not in (int, float) or value in spec.options.also:
        return value
    options = spec.options
    if spec.kind is float and options.finite and not math.isfinite(value):
        raise ConfigError(f"{where}: must be a finite number, got {value}")
    maximum = options.maximum if options.maximum is not None else (INT64_MAX if spec.kind is int else None)
    low_ok = ((options.above is None or value > options.above)
              and (options.minimum is None or value >= options.minimum))
    if not low_ok or (maximum is not None and value > maximum):
        bound = spec.range_text() or f"≤ {maximum}"
        shown = value if len(str(value)) <= 40 else f"{str(value)[:37]}..."
        raise ConfigError(f"{where}: must be {bound}, got {shown}")
    return value


# ----------------------------------------------------------------------------------------------------------
# Slices
# ----------------------------------------------------------------------------------------------------------
class Slice:
    """Base of the frozen slice dataclasses: their flags, a title for `--help`, and their own rules."""

    TITLE: ClassVar[str]
    DESCRIPTION: ClassVar[str]

    @classmethod
    @functools.cache
    def specs(cls) -> tuple[FlagSpec, ...]:
        return resolve_specs(cls, cls.TITLE)

    def validate(self) -> None:
        """Every declared type, choice and range (again: a slice may be built without `convert`), then `check`."""
        for spec in self.specs():
            value = getattr(self, spec.name)
            if value is None:
                if not spec.optional:
                    raise ConfigError(f"{spec.flag}: a value is required")
                continue
            values = value if spec.container is not None else (value,)
            for item in values:
                if type(item) is not spec.kind and not (spec.kind is float and type(item) is int):
                    raise ConfigError(f"{spec.flag}: expected {spec.kind.__name__}, got {type(item).__name__}")
                check_value(spec, item, spec.flag)
        self.check()

    def check(self) -> None:
        """This slice's own rules between its fields; raise ConfigError naming the flags."""
