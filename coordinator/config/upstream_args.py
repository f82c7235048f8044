"""The upstream flags that are not fields of a slice, on the command line: accepted (ignored), passed on
(sglang-router's `--router-*`), or refused with the feature and why — per `upstream_flags.tsv`.

Owns `add_upstream_arguments` (one hidden argparse argument per such row, taking what upstream's takes) and
`UpstreamFlags`, what a command line gave of them, with `refusal` (the one message naming every refused flag).

Invariants: a row's arity decides what argparse consumes after the flag (so an ignored flag's value is never
read as a flag of ours, nor a flag as its value); values of ignored flags are kept only to be counted, never
printed (one may be a secret); every flag here has a row.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

from coordinator.config.upstream import ORIGIN_NAMES, Row, upstream_rows

_DEST = "upstream:"
_NARGS = {"values": "+", "optional": "?"}


def _passed_to_router(row: Row) -> bool:
    return row.disposition == "implemented" and "sglang-router" in row.origins and row.flag.startswith("--router-")


def parser_rows(known: set[str]) -> list[Row]:
    """The rows the parser adds itself: ignored, refused and router flags that are not flags of a slice."""
    return [row for row in upstream_rows().values() if row.flag not in known
            and (row.disposition in ("ignored", "refused") or _passed_to_router(row))]


def add_upstream_arguments(parser: argparse.ArgumentParser, known: set[str]) -> None:
    group = parser.add_argument_group(
        "slime / miles / Megatron-LM / sglang-router flags",
        "accepted as upstream defines them, then ignored (with a notice), passed to sglang-router, or refused "
        "with the reason: see coordinator/config/upstream_flags.tsv and docs/porting.md")
    for row in parser_rows(known):
        kwargs: dict[str, Any] = {"dest": _DEST + row.flag, "default": argparse.SUPPRESS, "help": argparse.SUPPRESS}
        if row.arity == "switch":
            kwargs["action"] = "store_const"
            kwargs["const"] = True
        else:
            kwargs["nargs"] = _NARGS.get(row.arity, int(row.arity) if row.arity.isdigit() else None)
            kwargs["action"] = "append"  # a repeated flag (sglang-router's --router-prefill URL ...) keeps each
        group.add_argument(row.flag, **kwargs)


@dataclass(frozen=True)
class UpstreamFlags:
    """What a command line gave of the parser's upstream rows."""

    ignored: tuple[Row, ...] = ()
    refused: tuple[Row, ...] = ()
    #: sglang-router flags without slime's `router-` prefix, with their values, for the router's command line
    router_args: tuple[str, ...] = ()

    def refusal(self) -> str | None:
        if not self.refused:
            return None
        by_note: dict[str, list[Row]] = {}
        for row in self.refused:
            by_note.setdefault(row.note, []).append(row)
        lines = [f"{len(self.refused)} flag(s) of a slime/miles launch script that rayless refuses:"]
        for note, rows in by_note.items():
            origins = sorted({origin for row in rows for origin in row.origins}, key=list(ORIGIN_NAMES).index)
            lines.append(f"  {' '.join(row.flag for row in rows)} ({', '.join(ORIGIN_NAMES[o] for o in origins)}): "
                         f"{note}")
        return "\n".join(lines)


def take_upstream(given: dict[str, Any]) -> tuple[dict[str, Any], UpstreamFlags]:
    """`given` (argparse's namespace as a dict) without the upstream rows, and those rows by disposition."""
    rows = upstream_rows()
    rest: dict[str, Any] = {}
    ignored: list[Row] = []
    refused: list[Row] = []
    router: list[str] = []
    for dest, value in given.items():
        if not dest.startswith(_DEST):
            rest[dest] = value
            continue
        row = rows[dest[len(_DEST):]]
        if row.disposition == "refused":
            refused.append(row)
        elif row.disposition == "ignored":
            ignored.append(row)
        else:
            occurrences = [[]] if value is True else value
            for occurrence in occurrences:
                items = occurrence if isinstance(occurrence, list) else [occurrence]
                router += ["--" + row.flag[len("--router-"):], *(str(item) for item in items if item is not None)]
    return rest, UpstreamFlags(tuple(ignored), tuple(refused), tuple(router))
