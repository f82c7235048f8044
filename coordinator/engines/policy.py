"""The engine client's retry and deadline policy.

Owns: how often a failed request to an engine is tried again (`RetryPolicy`); the deadline each attempt runs
under is `transport.request_timeout`. Invariants: retries are bounded both in number and in total time; a
collective call (`COLLECTIVE`) is never repeated. Imports no HTTP library (hooks and the replay path use it).
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class RetryPolicy:
    """Bounded retries on transport errors and 5xx: exponential backoff with jitter and a total budget.

    `attempts` counts the first try (1 = no retry). No new attempt starts when its backoff would end past
    `budget` seconds after the first try began.
    """

    attempts: int = 3
    backoff: float = 0.2
    backoff_max: float = 3.0
    budget: float = 30.0

    def delay(self, attempt: int) -> float:
        base = min(self.backoff * (2 ** (attempt - 1)), self.backoff_max)
        return base * (0.5 + random.random() / 2)  # jitter so N callers don't retry in lockstep


NO_RETRY = RetryPolicy(attempts=1)

# Calls that must not be repeated: the server joins a collective / consumes broadcasts in order.
COLLECTIVE = NO_RETRY
