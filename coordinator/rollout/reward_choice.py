"""Which reward scores a prompt source: the one rule the rollout manager and the eval fleet share.

Owns the choice of a `RewardModel` from the reward flags (`--rm-type`, `--custom-rm-path`, `--group-rm`,
`--reward-key`, `--rm-url`). Invariants: `--custom-rm-path` wins over `--rm-type` (RewardModel's own rule); with neither
flag, a `builtin:<task>` prompt source is scored by its task's rm type; otherwise there is no reward (None)
and the caller names the flag to give.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from coordinator.data.tasks import builtin_task_name, get_task
from coordinator.rollout.rewards import RewardModel

if TYPE_CHECKING:
    from coordinator.config import RolloutConfig


@dataclass(frozen=True)
class RewardChoice:
    rm_type: str | None = None
    custom_rm_path: str | None = None
    group_rm: bool = False
    reward_key: str | None = None
    rm_url: str | None = None

    @classmethod
    def from_rollout(cls, rollout: RolloutConfig) -> RewardChoice:
        return cls(rm_type=rollout.rm_type, custom_rm_path=rollout.custom_rm_path, group_rm=rollout.group_rm,
                   reward_key=rollout.reward_key, rm_url=rollout.rm_url)

    def resolved(self, prompt_source: str | None) -> RewardChoice:
        """This choice, with the rm type of `prompt_source`'s built-in task when no reward flag names one."""
        task = builtin_task_name(prompt_source)
        if self.rm_type is None and self.custom_rm_path is None and task is not None:
            return dataclasses.replace(self, rm_type=get_task(task).rm_type)
        return self

    def model(self, *, args: argparse.Namespace | None = None) -> RewardModel | None:
        """The RewardModel of this choice; None when it names no reward. `args`: the hooks' args, which a
        slime-style custom rm gets first."""
        if self.rm_type is None and self.custom_rm_path is None:
            return None
        return RewardModel(rm_type=self.rm_type, custom_rm_path=self.custom_rm_path, group_rm=self.group_rm,
                           reward_key=self.reward_key, rm_url=self.rm_url, args=args)
