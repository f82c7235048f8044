"""The `math_verify` reward type: Hugging Face's Math-Verify (`pip install 'rayless[math-verify]'`).

Owns how a sample reaches Math-Verify: the label is parsed as LaTeX (wrapped in `$...$` unless it already
holds `$` or `\\boxed`, so `(1,2)` reads as an interval and `\\frac12` as a number; the bare label when that
finds nothing), the response with Math-Verify's defaults (the boxed answer first, else the last expression),
and `verify(gold, answer)` decides: 1.0 or 0.0. Math-Verify is more lenient than slime's `math`: it evaluates
(`\\boxed{2+3}` is 5) and reads unreduced fractions as their value.

Invariant: Math-Verify's time limits use `signal.alarm`, which only the main thread may set; off the main
thread they are off (Math-Verify's own advice), so the rule works from any thread. A missing package is a
RewardError naming the extra to install.
"""

from __future__ import annotations

import functools
import threading
from typing import Any

from workers.boundary.json_input import JsonValue
from workers.errors import RaylessError

PARSE_SECONDS = 5
VERIFY_SECONDS = 5


class MathVerifyMissing(RaylessError, ImportError):
    """Math-Verify is not installed."""


@functools.cache
def math_verify_library() -> Any:
    """The `math_verify` module; a clear error naming the extra when it is not installed."""
    try:
        import math_verify
    except ImportError as error:
        raise MathVerifyMissing(
            "rm-type math_verify needs Hugging Face's Math-Verify: pip install 'rayless[math-verify]' "
            f"(or pip install 'math-verify>=0.8,<0.10') ({error})"
        ) from None
    return math_verify


def _gold(library: Any, label: str, timeout: int | None) -> list[JsonValue]:
    if "$" not in label and "\\boxed" not in label:
        wrapped = library.parse(f"${label}$", parsing_timeout=timeout)
        if wrapped:
            return wrapped
    return library.parse(label, parsing_timeout=timeout)


def math_verify_reward(response: str, label: JsonValue) -> float:
    """1.0 when Math-Verify finds the response's answer equal to the label's, else 0.0."""
    library = math_verify_library()
    main = threading.current_thread() is threading.main_thread()
    parse_timeout, verify_timeout = (PARSE_SECONDS, VERIFY_SECONDS) if main else (None, None)
    gold = _gold(library, "" if label is None else str(label), parse_timeout)
    if not gold:
        return 0.0
    answer = library.parse(response, parsing_timeout=parse_timeout)
    if not answer:
        return 0.0
    return 1.0 if library.verify(gold, answer, timeout_seconds=verify_timeout) else 0.0
