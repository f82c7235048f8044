"""The Sample record: one generated (or replayed) response and everything training needs from it.

Owned here, in `replay/`, because both the coordinator (which produces samples) and the dump format
(which stores them) need it, and `replay` imports neither `coordinator` nor `workers`.

Invariant kept by `Sample.validate()`: `tokens` holds prompt + response, the response is the last
`response_length` tokens, and `loss_mask` / `rollout_log_probs` have exactly `response_length` entries.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

Reward = float | dict[str, float] | None


class SampleStatus(str, enum.Enum):
    PENDING = "pending"
    COMPLETED = "completed"
    TRUNCATED = "truncated"
    ABORTED = "aborted"


class SampleError(ValueError):
    """A sample whose fields contradict each other."""


@dataclass
class Sample:
    group_index: int
    sample_index: int
    prompt: str
    tokens: list[int]
    response_length: int
    loss_mask: list[int]
    rollout_log_probs: list[float]
    reward: Reward = None
    status: SampleStatus = SampleStatus.PENDING
    weight_versions: list[str] = field(default_factory=list)
    label: str | None = None
    response: str = ""
    advantage: float = 0.0
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def prompt_length(self) -> int:
        return len(self.tokens) - self.response_length

    @property
    def response_tokens(self) -> list[int]:
        return self.tokens[self.prompt_length :]

    def scalar_reward(self, reward_key: str | None = None) -> float:
        """The reward used for advantages: the float itself, or `reward[reward_key]` for dict rewards."""
        if self.reward is None:
            raise SampleError(f"sample {self.group_index}/{self.sample_index} has no reward yet")
        if isinstance(self.reward, dict):
            if reward_key is None:
                raise SampleError(
                    f"sample {self.group_index}/{self.sample_index} has a dict reward "
                    f"({sorted(self.reward)}); pass --reward-key to choose one"
                )
            if reward_key not in self.reward:
                raise SampleError(
                    f"--reward-key {reward_key!r} is not in the reward of sample "
                    f"{self.group_index}/{self.sample_index} (keys: {sorted(self.reward)})"
                )
            return float(self.reward[reward_key])
        return float(self.reward)

    def validate(self) -> None:
        where = f"sample {self.group_index}/{self.sample_index}"
        if self.response_length < 0 or self.response_length > len(self.tokens):
            raise SampleError(
                f"{where}: response_length {self.response_length} outside 0..{len(self.tokens)} tokens"
            )
        if len(self.loss_mask) != self.response_length:
            raise SampleError(
                f"{where}: loss_mask has {len(self.loss_mask)} entries, response_length is {self.response_length}"
            )
        if len(self.rollout_log_probs) != self.response_length:
            raise SampleError(
                f"{where}: rollout_log_probs has {len(self.rollout_log_probs)} entries, "
                f"response_length is {self.response_length}"
            )
        if not isinstance(self.status, SampleStatus):
            raise SampleError(f"{where}: status {self.status!r} is not a SampleStatus")


@dataclass
class RolloutBatch:
    """What a data source hands the training loop for one rollout id: groups of samples plus metrics."""

    rollout_id: int
    groups: list[list[Sample]]
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def samples(self) -> list[Sample]:
        return [sample for group in self.groups for sample in group]
