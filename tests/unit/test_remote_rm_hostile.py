"""A hostile reward service (`--rm-url`, the real HTTP server of tests/support/reward_server.py): each bad answer
— nested 100k deep, 20 MB, NaN, infinity, a list, a NaN inside a dict — fails its sample with one
`RewardError` naming `--rm-url` and the sample, never a RecursionError or a reward of NaN; the 20 MB answer
is cut at the 1 MiB cap."""

from __future__ import annotations

import pytest

from coordinator.rewards.rules import RewardError
from coordinator.rollout.rewards import RewardModel
from replay.sample import Sample
from tests.support.memory import PeakMemory
from tests.support.reward_server import HOSTILE, serve


@pytest.mark.parametrize("kind", sorted(HOSTILE))
async def test_a_hostile_reward_answer_is_one_reward_error(kind: str) -> None:
    with serve() as service:
        sample = Sample(group_index=0, sample_index=0, prompt="p", response="r", label=f"hostile:{kind}")
        memory = PeakMemory()
        with pytest.raises(RewardError, match=r"--rm-url .*/score.*sample 0/0") as caught:
            await RewardModel(rm_type="remote_rm", rm_url=service.url, reward_key="score").score_group([sample])
        assert memory.growth_mib < 64, f"{kind}: refusing one answer grew {memory.growth_mib:.0f} MiB"
        assert sample.reward is None
        assert service.per_label[f"hostile:{kind}"] == 1, "a refused answer is not asked again"
        if kind in ("deep", "huge", "nan", "nan_in_dict"):
            assert "refused reply" in str(caught.value)
