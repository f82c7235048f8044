"""pass@k of prompt groups, as slime computes it (`--log-passrate`, and every eval dataset's `-pass@k`).

Owns `pass_at_k` (the unbiased estimator 1 - C(n-c, k) / C(n, k) of one prompt with c of n samples right) and
`pass_rates` (its mean over groups, for k = 1, 2, 4, ... up to the largest group). A sample counts as right
when its reward is 1 or more. Invariant: a group enters the mean for k only when it has at least k samples
(slime's ragged rule, so filtered or over-sampled batches never divide by a size they do not have); a k that
no group reaches is left out, and groups of one sample give nothing.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def pass_at_k(n: int, correct: int, k: int) -> float:
    """The unbiased pass@k of one prompt with `correct` of its `n` samples right."""
    if n - correct < k:
        return 1.0
    return 1.0 - math.comb(n - correct, k) / math.comb(n, k)


def pass_rates(groups: Sequence[Sequence[float]]) -> dict[int, float]:
    """{k: mean pass@k over the groups of at least k samples} for k = 1, 2, 4, ... ≤ the largest group, from
    each group's rewards."""
    largest = max((len(group) for group in groups), default=0)
    if largest <= 1:
        return {}
    rates: dict[int, float] = {}
    k = 1
    while k <= largest:
        eligible = [group for group in groups if len(group) >= k]
        rates[k] = sum(pass_at_k(len(g), sum(r >= 1.0 for r in g), k) for g in eligible) / len(eligible)
        k *= 2
    return rates
