"""What a dump's samples must mean, beyond their form: the checks of `rayless dump verify`.

Owns `MeaningCheck`, fed one `Sample` at a time (memory: one key per sample for the group checks). The
reader already guarantees form (types, lengths of `loss_mask` / `rollout_log_probs` against
`response_length`); this adds what a trainer would otherwise take in silently: numbers that are finite,
indices that are not negative and do not repeat, token ids that fit int32 (and the vocabulary when known),
loss-mask entries that are 0 or 1, logprobs that are log-probabilities (≤ 0). Invariant: every problem is
one line naming the sample (`sample #k (group/sample)`) and the field; the first is kept with a count.
"""

from __future__ import annotations

import math

from replay.sample import Sample

INT32_MAX = 2**31 - 1
#: a logprob above this is not a log-probability (engines return log-softmax values, ≤ 0 up to rounding)
LOGPROB_MAX = 1e-3


def _finite(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def reward_problem(reward: object) -> str | None:
    if reward is None:
        return None
    if isinstance(reward, dict):
        bad = next((key for key, value in reward.items() if not _finite(value)), None)
        return None if bad is None else f"reward[{bad!r}] {reward[bad]!r} is not a finite number"
    return None if _finite(reward) else f"reward {reward!r} is not a finite number"


def token_problem(tokens: list[int], vocab_size: int | None) -> str | None:
    if not tokens:
        return None
    low, high = min(tokens), max(tokens)
    if low < 0:
        return f"token id {low} is negative"
    if high > INT32_MAX:
        return f"token id {high} does not fit int32 (engines and the trainer hold ids as int32)"
    if vocab_size is not None and high >= vocab_size:
        return f"token id {high} is outside the vocabulary of {vocab_size}"
    return None


def sample_problems(sample: Sample, vocab_size: int | None = None) -> list[str]:
    """What is wrong with one sample alone (every field of `replay.sample.Sample` that has a meaning)."""
    problems = []
    for name in ("group_index", "sample_index"):
        if getattr(sample, name) < 0:
            problems.append(f"{name} {getattr(sample, name)} is negative")
    if sample.index is not None and sample.index < 0:
        problems.append(f"index {sample.index} is negative")
    for problem in (reward_problem(sample.reward), token_problem(sample.tokens, vocab_size)):
        if problem is not None:
            problems.append(problem)
    if not _finite(sample.advantage):
        problems.append(f"advantage {sample.advantage!r} is not a finite number")
    if not set(sample.loss_mask) <= {0, 1}:
        mask = next(value for value in sample.loss_mask if value not in (0, 1))
        problems.append(f"loss_mask holds {mask}; entries are 0 or 1")
    problem = logprob_problem(sample.rollout_log_probs)
    if problem is not None:
        problems.append(problem)
    return problems


def logprob_problem(logprobs: list[float]) -> str | None:
    # C-speed first: a sum of values ≤ ~0 is finite exactly when they all are (one pass of `sum` and `max`);
    # the Python scan only runs to name the bad one.
    if not logprobs or (math.isfinite(sum(logprobs)) and max(logprobs) <= LOGPROB_MAX):
        return None
    bad = next((i for i, value in enumerate(logprobs) if not math.isfinite(value)), None)
    if bad is not None:
        return f"rollout logprob {logprobs[bad]} at response token {bad} is not finite"
    high = max(logprobs)
    return f"rollout logprob {high} is above 0 (not a log-probability)" if high > LOGPROB_MAX else None


class MeaningCheck:
    """Feed every sample of one dump in file order; `problems` and `first` say what is wrong."""

    def __init__(self, vocab_size: int | None = None, *, repeats: bool = True) -> None:
        """`repeats`: also count a (group, sample_index) or an `index` given twice (harmless to training)."""
        self.vocab_size = vocab_size
        self.repeats = repeats
        self.problems = 0
        self.first: str | None = None
        self._positions: set[tuple[int, int]] = set()
        self._indices: set[int] = set()
        self._count = 0

    def add(self, sample: Sample) -> None:
        where = f"sample #{self._count} ({sample.group_index}/{sample.sample_index})"
        self._count += 1
        found = sample_problems(sample, self.vocab_size) + (self._repeated(sample) if self.repeats else [])
        if found:
            self.problems += len(found)
            self.first = self.first or f"{where}: {found[0]}"

    def _repeated(self, sample: Sample) -> list[str]:
        found = []
        position = (sample.group_index, sample.sample_index)
        if position in self._positions:
            found.append(f"group {position[0]} holds sample_index {position[1]} twice")
        self._positions.add(position)
        if sample.index is not None:
            if sample.index in self._indices:
                found.append(f"index {sample.index} is given to two samples")
            self._indices.add(sample.index)
        return found

    def summary(self) -> str | None:
        """`sample #k (g/s): reason (and N further problem(s))`, or None when every sample means something."""
        if self.first is None:
            return None
        more = f" (and {self.problems - 1} further problem(s))" if self.problems > 1 else ""
        return self.first + more
