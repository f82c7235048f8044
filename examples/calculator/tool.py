"""The calculator tool of the example: adds the two digits of a prompt like `3+4`.

A stand-in for any tool a generate function calls (a sandbox, a search engine): plain Python, no service.
"""

from __future__ import annotations

import re

_SUM = re.compile(r"^\s*(\d+)\s*\+\s*(\d+)\s*$")


def calculate(expression: str) -> str:
    """`3+4` → `7`; anything that is not `<digits>+<digits>` → `error`."""
    match = _SUM.match(expression)
    if match is None:
        return "error"
    return str(int(match.group(1)) + int(match.group(2)))
