"""The report of command-line flags rayless does not know: one per line, grouped by where they come from,
each with the closest flag we do know.

Owns `unknown_flags_report` (the one place that message is written). Every flag of slime, miles, Megatron-LM
and sglang-router is a row of `upstream_flags.tsv` and so reaches the parser, never this report: "unknown"
here means unknown to all of them, and the message says which versions were checked. A value following an
unknown flag is never shown (it may be a secret).
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable, Sequence


def _origins() -> tuple[tuple[str, str], ...]:
    from coordinator.config.upstream import checked_versions

    return (("unknown", "not a flag of rayless, nor of slime, miles, Megatron-LM, sglang-router (--router-*) or "
                        f"SGLang (--sglang-*) at the versions checked: {checked_versions()}"),)


_NUMBER = re.compile(r"^-\d|^-\.\d")


def closest_flag(flag: str, known: Iterable[str]) -> str | None:
    """The known flag `flag` most likely meant: one it abbreviates, else the nearest by spelling."""
    known = sorted(known)
    extensions = [candidate for candidate in known if candidate.startswith(flag + "-")]
    if len(extensions) == 1:
        return extensions[0]
    matches = difflib.get_close_matches(flag, known, n=1, cutoff=0.6)
    return matches[0] if matches else None


def unknown_flags_report(tokens: Sequence[str], known: Iterable[str]) -> str:
    """The message for the command-line tokens argparse did not take (flags and their values)."""
    known = list(known)
    flags: list[str] = []
    stray: list[str] = []
    after_flag = False
    for token in tokens:
        if token.startswith("-") and not _NUMBER.match(token):
            name = token.partition("=")[0]
            if name not in flags:
                flags.append(name)
            after_flag = True
        elif not after_flag:
            stray.append(token)
    lines = [f"{len(flags)} unrecognised flag(s):" if flags else "unrecognised arguments:"]
    width = max((len(flag) for flag in flags), default=0)
    for origin, why in _origins() if flags else ():
        lines.append(f"  {origin} ({why}):")
        for flag in flags:
            suggestion = closest_flag(flag, known)
            hint = f"   did you mean {suggestion}?" if suggestion else ""
            lines.append(f"    {flag:<{width}}{hint}".rstrip())
    if stray:
        lines.append("  values without a flag: " + " ".join(repr(value) for value in stray))
    return "\n".join(lines)
