"""The one base class of rayless's known failures: `RaylessError`, and whether a person can act on one.

Owns the rule that decides how a failure is reported: an error whose class says `user_facing = True` is a
known failure (bad input, a process that died, an engine that answered an error) and is printed as its
message alone, one clear line saying what failed, where and what to do; anything else is a bug of ours and
is printed with its traceback.

Lives in `workers` because every package of ours that raises a known failure may import it: `coordinator`
imports `workers` (never the reverse), and `workers` itself raises known failures. `replay` imports neither
package, so its `DumpError` stays its own class; the coordinator lists it beside this base
(`coordinator.lifecycle.failures`). Importing this module imports nothing else.
"""

from __future__ import annotations


class RaylessError(Exception):
    """A known failure. Subclasses keep their historical bases too (ValueError, RuntimeError) for callers
    that catch those.

    `user_facing`: True when the message alone tells a person what failed and what to do, so the run prints
    it without a traceback; a subclass that signals a bug of ours sets it to False.
    """

    user_facing: bool = True
