"""Real rollout functions used by tests through --rollout-function-path (they count their constructions)."""

from __future__ import annotations

from typing import Any, ClassVar

from coordinator.rollout.generate import DefaultRollout
from replay.sample import RolloutBatch, Sample, SampleStatus

CONSTRUCTED: list[str] = []


class CountingRollout:
    """An SFT-style producer: builds fixed samples without engines; counts how often it is constructed."""

    def __init__(self, context: Any) -> None:
        CONSTRUCTED.append(type(self).__name__)
        self.context = context

    async def __call__(self, rollout_id: int, weight_version: str) -> RolloutBatch:
        groups = []
        for group in range(2):
            samples = []
            for index in range(2):
                samples.append(Sample(group_index=group, sample_index=index, prompt="1 2 3=", tokens=[8, 9, 10, 11],
                                      response_length=2, loss_mask=[1, 1], rollout_log_probs=[-1.0, -2.0],
                                      reward=float(index), status=SampleStatus.COMPLETED,
                                      weight_versions=[weight_version]))
            groups.append(samples)
        return RolloutBatch(rollout_id=rollout_id, groups=groups)


class OtherCountingRollout(CountingRollout):
    pass


def plain_function_rollout(context: Any, rollout_id: int, weight_version: str) -> list[list[Sample]]:
    CONSTRUCTED.append("plain")
    return [[Sample(group_index=0, sample_index=0, prompt="p", tokens=[1, 2], response_length=1, loss_mask=[1],
                    rollout_log_probs=[-0.5], reward=1.0, status=SampleStatus.COMPLETED)]]


def alternating_constant_reward(sample: Sample) -> float:
    """Even prompts: every sample scores 1.0 (zero std, dropped by reward_std_positive); odd: 0/1 by sample."""
    if sample.metadata["prompt_index"] % 2 == 0:
        return 1.0
    return float(sample.sample_index % 2)


def offset_first_digit_reward(sample: Sample) -> float:
    """The first_digit task's score plus 1: the same ranking of samples, at a level a value model must learn
    (a fresh critic predicts 0), so a critic's value loss has somewhere to fall from."""
    from coordinator.rewards.rules import first_digit

    return 1.0 + first_digit(sample.response, sample)


class RecordedDefaultRollout(DefaultRollout):
    """The default rollout function, unchanged, keeping each instance built in `BUILT`: a test reads its public
    state (`partial_buffer`) after a rollout."""

    BUILT: ClassVar[list[RecordedDefaultRollout]] = []

    def __init__(self, context: Any) -> None:
        super().__init__(context)
        RecordedDefaultRollout.BUILT.append(self)
