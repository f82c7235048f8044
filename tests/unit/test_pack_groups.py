"""A step's micro-batches built at once (`packing.pack_groups`: one concatenation per field) are the tensors the
sample-by-sample construction gives, field for field and bit for bit, decoded from a real frame or built
in-process; first-fit-decreasing's plan is unchanged by skipping full bins."""

from __future__ import annotations

import dataclasses
import math
import random

import msgspec
import numpy as np
import pytest
import torch

from workers import protocol
from workers.protocol.arrays import Kind, PackedArray, as_numpy
from workers.train_rank.batching import MicroBatch, fill_response
from workers.train_rank.packing import first_fit_decreasing, pack, pack_groups, plan, split_to_count


def reference_pack(samples: list[protocol.WireSample], pad_token_id: int) -> MicroBatch:
    """The micro-batch built sample by sample, as `pack` did before `pack_groups` (the oracle)."""
    if not samples:
        zeros = torch.zeros((1, 1), dtype=torch.float32)
        return MicroBatch(torch.full((1, 2), pad_token_id, dtype=torch.long), None, zeros, zeros.clone(),
                          zeros.clone(), 0, (), (), torch.arange(2).unsqueeze(0), torch.zeros((1, 1), dtype=torch.long))
    total = sum(len(sample.tokens) for sample in samples)
    input_ids = torch.from_numpy(np.concatenate([as_numpy(Kind.TOKENS, s.tokens) for s in samples]).astype(np.int64))
    position_ids = torch.cat([torch.arange(len(sample.tokens)) for sample in samples])
    loss_mask, rollout, advantages = (torch.zeros(total - 1, dtype=torch.float32) for _ in range(3))
    sample_ids = torch.full((total - 1,), len(samples), dtype=torch.long)
    spans, offset = [], 0
    for index, sample in enumerate(samples):
        count = len(sample.tokens)
        start = offset + count - sample.response_length - 1
        fill_response(sample, loss_mask, rollout, advantages, start)
        sample_ids[offset : offset + count - 1] = index
        spans.append((start, offset + count - 1))
        offset += count
    return MicroBatch(input_ids.unsqueeze(0), None, loss_mask.unsqueeze(0), rollout.unsqueeze(0),
                      advantages.unsqueeze(0), total, tuple(spans), tuple(len(s.tokens) for s in samples),
                      position_ids.unsqueeze(0), sample_ids.unsqueeze(0))


def assert_same(expected: MicroBatch, got: MicroBatch) -> None:
    for field in dataclasses.fields(MicroBatch):
        want, have = getattr(expected, field.name), getattr(got, field.name)
        if isinstance(want, torch.Tensor):
            assert isinstance(have, torch.Tensor) and have.dtype == want.dtype and have.shape == want.shape
            assert want.numpy().tobytes() == have.numpy().tobytes(), field.name  # bit for bit
        else:
            assert have == want, field.name


def wire_samples(rng: random.Random, count: int) -> list[protocol.WireSample]:
    samples = []
    for _ in range(count):
        response = rng.choice([0, 1, 2, rng.randint(3, 90)])
        tokens = [rng.randrange(50_000) for _ in range(rng.randint(1, 40) + response)]
        mask = [rng.choice([0, 1, 1, 3]) for _ in range(response)]  # a mask value > 1 is kept as it is
        logprobs = [-rng.random() * 5 for _ in range(response)]
        for position in range(response):  # off the mask a logprob may be anything: it becomes 0.0
            if mask[position] == 0 and rng.random() < 0.3:
                logprobs[position] = rng.choice([math.nan, -math.inf, -0.0])
        samples.append(protocol.WireSample(tokens=tokens, response_length=response, loss_mask=mask,
                                           rollout_log_probs=logprobs, advantage=rng.uniform(-2, 2) / 3))
    return samples


def decoded(samples: list[protocol.WireSample]) -> list[protocol.WireSample]:
    """The samples as a rank has them: decoded from a real frame (views of its buffer)."""
    frame = protocol.encode_frame(protocol.Request(1, protocol.TrainCommand(0, [samples], [1])))
    request = protocol.decode_body(bytes(frame[4:]))
    return request.command.steps[0]


@pytest.mark.parametrize("seed", range(6))
def test_pack_groups_equals_packing_each_group_sample_by_sample(seed: int) -> None:
    rng = random.Random(seed)
    samples = wire_samples(rng, rng.randint(1, 40))
    for received in (samples, decoded(samples)):
        for capacity in (40, 120, 400, 10**6):
            groups = plan(received, max_tokens=capacity, micro_batch_size=None)
            stretched = split_to_count(groups, [len(s.tokens) for s in received], len(groups) + 3)
            for layout in (groups, stretched, [[], *groups, []], [list(reversed(g)) for g in groups]):
                built = pack_groups(received, layout, 7)
                assert len(built) == len(layout)
                for group, batch in zip(layout, built, strict=True):
                    assert_same(reference_pack([received[i] for i in group], 7), batch)
                    assert_same(batch, pack([received[i] for i in group], 7))


def test_pack_groups_reads_packed_arrays_and_lists_alike() -> None:
    samples = wire_samples(random.Random(9), 12)
    as_arrays = [msgspec.structs.replace(s, tokens=PackedArray.of(Kind.TOKENS, np.asarray(s.tokens, dtype=np.int64)))
                 for s in samples]
    groups = plan(samples, max_tokens=100, micro_batch_size=None)
    for plain, arrays in zip(pack_groups(samples, groups, 0), pack_groups(as_arrays, groups, 0), strict=True):
        assert_same(plain, arrays)


def test_first_fit_decreasing_skipping_full_bins_gives_the_same_plan() -> None:
    def reference(lengths: list[int], capacity: int) -> list[list[int]]:
        bins: list[list[int]] = []
        loads: list[int] = []
        for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
            target = next((b for b, load in enumerate(loads) if load + lengths[index] <= capacity), None)
            if target is None:
                bins.append([])
                loads.append(0)
                target = len(bins) - 1
            bins[target].append(index)
            loads[target] += lengths[index]
        return [sorted(group) for group in bins]

    rng = random.Random(0)
    for _ in range(3000):
        capacity = rng.randint(1, 100)
        lengths = [rng.randint(0, 120) for _ in range(rng.randint(0, 30))]
        assert first_fit_decreasing(lengths, capacity) == reference(lengths, capacity)
