"""`WireSample.from_sample` (workers/protocol/control.py): plain lists are packed by `array` in C, everything else
takes the per-value path, and both read back as the same plain ints and floats."""

from __future__ import annotations

import math

import numpy as np
import pytest

from replay.sample import Sample
from workers.protocol import WireSample


def sample(tokens: object, loss_mask: object, logprobs: object, teacher: object = None) -> Sample:
    record = Sample(prompt="p", tokens=[1, 2, 3, 4], response_length=2, loss_mask=[1, 1],
                    rollout_log_probs=[-0.5, -0.25], advantage=0.5)
    # set after construction: the generate path, the dump reader and hooks each hand over their own types
    record.tokens, record.loss_mask, record.rollout_log_probs = tokens, loss_mask, logprobs  # type: ignore[assignment]
    record.teacher_log_probs = teacher  # type: ignore[assignment]
    return record


@pytest.mark.parametrize("convert", [
    lambda values: values,  # plain lists: the fast path
    lambda values: [np.int64(v) if isinstance(v, int) else np.float32(v) for v in values],  # numpy scalars
])
def test_every_form_gives_the_same_plain_values(convert: object) -> None:
    tokens, mask, logprobs = [5, 6, 7, 8], [1, 0], [-0.5, -0.125]
    wire = WireSample.from_sample(sample(convert(tokens), convert(mask), convert(logprobs),  # type: ignore[operator]
                                         convert(logprobs)))  # type: ignore[operator]
    assert wire.tokens == tokens and all(type(t) is int for t in wire.tokens)
    assert wire.loss_mask == mask and all(type(m) is int for m in wire.loss_mask)
    assert wire.rollout_log_probs == logprobs and all(type(x) is float for x in wire.rollout_log_probs)
    assert wire.teacher_log_probs == logprobs and all(type(x) is float for x in wire.teacher_log_probs or [])


def test_bools_ints_as_floats_and_special_floats_keep_their_old_meaning() -> None:
    wire = WireSample.from_sample(sample([1, 2, 3, 4], [True, False], [-1, float("-inf")]))
    assert wire.loss_mask == [1, 0] and all(type(m) is int for m in wire.loss_mask)
    assert wire.rollout_log_probs[0] == -1.0 and type(wire.rollout_log_probs[0]) is float
    assert math.isinf(wire.rollout_log_probs[1])
    floats_as_tokens = WireSample.from_sample(sample([1.0, 2.0, 3.0, 4.0], [1, 1], [-0.5, -0.5]))
    assert floats_as_tokens.tokens == [1, 2, 3, 4] and all(type(t) is int for t in floats_as_tokens.tokens)
    assert WireSample.from_sample(sample([1, 2, 3, 4], [1, 1], [-0.5, -0.5])).teacher_log_probs is None
