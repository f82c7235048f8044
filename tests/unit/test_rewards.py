"""The reward router (built-in types, per-sample rm_type, custom rms) and hook loading. The rules of the
built-in types are tested in test_reward_rules.py."""

from __future__ import annotations

import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import anyio
import anyio.lowlevel
import pytest

from coordinator.rollout.rewards import RewardError, RewardModel
from replay.sample import Sample, SampleStatus
from workers.hook_loading import HookLoadError, load_object


def make_sample(
    response: str, label: str | None = "3", *, index: int = 0, status: SampleStatus = SampleStatus.COMPLETED
) -> Sample:
    return Sample(
        group_index=0,
        sample_index=index,
        prompt="3 7 1=",
        tokens=[1, 2, 3, 4],
        response_length=0,
        loss_mask=[],
        rollout_log_probs=[],
        status=status,
        label=label,
        response=response,
    )


def group(*responses: str, label: str | None = "3") -> list[Sample]:
    return [make_sample(response, label, index=index) for index, response in enumerate(responses)]


@pytest.fixture
def hook_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A directory on sys.path where a test writes a real module for a hook path to import."""
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for name in [name for name in sys.modules if name.startswith("rm_hooks")]:
        del sys.modules[name]


def write_module(directory: Path, name: str, source: str) -> None:
    (directory / f"{name}.py").write_text(textwrap.dedent(source), encoding="utf-8")


# ------------------------------------------------------------------------------------------------- router


async def test_builtin_router_sets_rewards_and_skips_aborted() -> None:
    samples = group("3333", "3xx3", "9999")
    samples.append(make_sample("3333", index=3, status=SampleStatus.ABORTED))
    await RewardModel(rm_type="first_digit").score_group(samples)
    assert [sample.reward for sample in samples] == [1.0, 0.5, 0.0, 0.0]


async def test_builtin_needs_label() -> None:
    with pytest.raises(
        RewardError, match=r"--rm-type math needs a label but sample 0/0 has none.*--label-key"
    ):
        await RewardModel(rm_type="math").score_group(group("1", label=None))


def test_unknown_rm_type_and_no_reward_fail_clearly() -> None:
    with pytest.raises(
        RewardError, match=r"--rm-type: rm-type 'f2' is not a built-in reward; known: char_match, dapo"
    ):
        RewardModel(rm_type="f2")
    with pytest.raises(RewardError, match=r"rm-type remote_rm needs --rm-url"):
        RewardModel(rm_type="remote_rm")
    with pytest.raises(RewardError, match=r"set --rm-type or --custom-rm-path"):
        RewardModel()


async def test_custom_sync_rm_from_path(hook_dir: Path) -> None:
    write_module(
        hook_dir,
        "rm_hooks_sync",
        """
        def length_reward(sample):
            return len(sample.response)
        """,
    )
    samples = group("a", "abc")
    await RewardModel(custom_rm_path="rm_hooks_sync:length_reward").score_group(samples)
    assert [sample.reward for sample in samples] == [1.0, 3.0]
    assert all(isinstance(sample.reward, float) for sample in samples)


async def test_custom_async_rm_runs_group_concurrently() -> None:
    # Each call waits until all of the group's calls have started: this only finishes when they run together.
    started = anyio.Event()
    calls: list[int] = []

    async def rendezvous_reward(sample: Sample) -> float:
        calls.append(sample.sample_index)
        if len(calls) == 3:
            started.set()
        with anyio.fail_after(5):
            await started.wait()
        return float(sample.sample_index)

    samples = group("a", "b", "c")
    await RewardModel(custom_rm=rendezvous_reward).score_group(samples)
    assert [sample.reward for sample in samples] == [0.0, 1.0, 2.0]


async def test_async_callable_object_is_awaited() -> None:
    class Remote:
        async def __call__(self, sample: Sample) -> dict[str, float]:
            await anyio.lowlevel.checkpoint()
            return {"acc": 1.0, "len": float(len(sample.response))}

    samples = group("ab")
    await RewardModel(custom_rm=Remote(), reward_key="acc").score_group(samples)
    assert samples[0].reward == {"acc": 1.0, "len": 2.0}
    assert samples[0].scalar_reward("acc") == 1.0


async def test_group_rm_sync_and_async(hook_dir: Path) -> None:
    write_module(
        hook_dir,
        "rm_hooks_group",
        """
        def rank(samples):
            order = sorted(range(len(samples)), key=lambda i: len(samples[i].response))
            return [float(order.index(i)) for i in range(len(samples))]

        async def arank(samples):
            return rank(samples)
        """,
    )
    for path in ("rm_hooks_group:rank", "rm_hooks_group.arank"):
        samples = group("aaa", "a", "aa")
        await RewardModel(custom_rm_path=path, group_rm=True).score_group(samples)
        assert [sample.reward for sample in samples] == [2.0, 0.0, 1.0]


async def test_group_rm_sees_only_scored_samples() -> None:
    seen: list[int] = []

    def record(samples: list[Sample]) -> list[float]:
        seen.extend(sample.sample_index for sample in samples)
        return [1.0] * len(samples)

    samples = group("a", "b", "c")
    samples[1].status = SampleStatus.ABORTED
    await RewardModel(custom_rm=record, group_rm=True).score_group(samples)
    assert seen == [0, 2]
    assert [sample.reward for sample in samples] == [1.0, 0.0, 1.0]


@pytest.mark.parametrize(
    ("returned", "message"),
    [
        ("1.0", r"returned str .*expected a float or a dict\[str, float\]"),
        (None, r"returned NoneType"),
        (float("nan"), r"returned nan for sample 0/0; rewards must be finite"),
        ({"acc": "x"}, r"dict with entry 'acc': 'x'"),
        ({"other": 1.0}, r"--reward-key 'acc' is not in the reward .*keys: \['other'\]"),
    ],
)
async def test_custom_rm_wrong_type(returned: object, message: str) -> None:
    model = RewardModel(custom_rm=lambda sample: returned, reward_key="acc")
    with pytest.raises(RewardError, match=message):
        await model.score_group(group("a"))


async def test_dict_reward_without_reward_key_fails() -> None:
    with pytest.raises(RewardError, match=r"dict reward \(\['a', 'b'\]\).*pass --reward-key"):
        await RewardModel(custom_rm=lambda sample: {"a": 1.0, "b": 0.0}).score_group(group("a"))


async def test_group_rm_wrong_length_or_type() -> None:
    with pytest.raises(RewardError, match=r"--group-rm returned 1 rewards for a group of 2 samples"):
        await RewardModel(custom_rm=lambda samples: [1.0], group_rm=True).score_group(group("a", "b"))
    with pytest.raises(RewardError, match=r"--group-rm returned float; expected a list of 2 rewards"):
        await RewardModel(custom_rm=lambda samples: 1.0, group_rm=True).score_group(group("a", "b"))


# ---------------------------------------------------------------------------------------------- loading


def test_load_object_forms(hook_dir: Path) -> None:
    write_module(
        hook_dir,
        "rm_hooks_forms",
        """
        class Holder:
            @staticmethod
            def reward(sample):
                return 1.0
        def plain(sample):
            return 0.0
        """,
    )
    assert load_object("rm_hooks_forms:plain", what="--x").__name__ == "plain"
    assert load_object("rm_hooks_forms.plain", what="--x").__name__ == "plain"
    assert load_object("rm_hooks_forms:Holder.reward", what="--x").__qualname__ == "Holder.reward"
    assert load_object("rm_hooks_forms.Holder.reward", what="--x").__qualname__ == "Holder.reward"
    assert load_object("coordinator.rollout.filters:reward_std_positive", what="--x").__name__ == (
        "reward_std_positive"
    )


def test_load_object_errors_name_the_flag(hook_dir: Path) -> None:
    write_module(hook_dir, "rm_hooks_broken", "import rm_hooks_missing_dependency\n")
    write_module(hook_dir, "rm_hooks_raises", "raise RuntimeError('boom at import')\n")
    write_module(hook_dir, "rm_hooks_ok", "def f(sample):\n    return 1.0\n")
    cases = {
        "no_such_module:f": r"--custom-rm-path 'no_such_module:f': module 'no_such_module' not found",
        "no_such_pkg.mod.f": r"--custom-rm-path 'no_such_pkg.mod.f': no module found",
        "rm_hooks_ok:g": r"--custom-rm-path 'rm_hooks_ok:g': 'rm_hooks_ok' has no attribute 'g'",
        "rm_hooks_ok.g": r"'rm_hooks_ok' has no attribute 'g'",
        "rm_hooks_broken:f": r"importing module 'rm_hooks_broken' failed: No module named 'rm_hooks_missing",
        "rm_hooks_raises:f": r"importing module 'rm_hooks_raises' raised RuntimeError: boom at import",
        "justaname": r"expected 'module.path:Name' or 'module.path.Name'",
        "mod:": r"expected 'module.path:Name'",
        "": r"expected 'module.path:Name'",
    }
    for path, message in cases.items():
        with pytest.raises(HookLoadError, match=message):
            load_object(path, what="--custom-rm-path")


def test_custom_rm_path_errors_surface_from_reward_model(hook_dir: Path) -> None:
    write_module(hook_dir, "rm_hooks_value", "NOT_CALLABLE = 3\n")
    with pytest.raises(HookLoadError, match=r"--custom-rm-path 'rm_hooks_value:nope'"):
        RewardModel(custom_rm_path="rm_hooks_value:nope")
    with pytest.raises(RewardError, match=r"--custom-rm-path 'rm_hooks_value:NOT_CALLABLE' is not callable"):
        RewardModel(custom_rm_path="rm_hooks_value:NOT_CALLABLE")


# ------------------------------------------------------------------------------- per-sample type, dicts


async def test_a_samples_own_rm_type_wins_over_the_flag() -> None:
    """slime's order: metadata["rm_type"] (an eval dataset's, or a data row's) before --rm-type."""
    samples = group(r"<think>x</think> \boxed{3}", r"\boxed{3}")
    samples[1].metadata["rm_type"] = "math"
    await RewardModel(rm_type="deepscaler").score_group(samples)
    assert [sample.reward for sample in samples] == [1.0, 1.0]
    samples[0].metadata["rm_type"] = "no_such_type"
    with pytest.raises(RewardError, match=r"metadata rm_type of sample 0/0: rm-type 'no_such_type' is not"):
        await RewardModel(rm_type="math").score_group(samples)


async def test_dapo_dict_reward_and_a_bad_label_name_the_sample() -> None:
    samples = group("Answer: 3", "Answer: 4")
    await RewardModel(rm_type="dapo", reward_key="score").score_group(samples)
    assert [sample.scalar_reward("score") for sample in samples] == [1.0, -1.0]
    assert samples[0].reward == {"score": 1.0, "acc": 1.0}
    with pytest.raises(RewardError, match=r"--rm-type dapo returned a dict reward .*pass --reward-key"):
        await RewardModel(rm_type="dapo").score_group(group("Answer: 3"))
    with pytest.raises(RewardError, match=r"needs an integer label .*'three'.* \(sample 0/0\)"):
        await RewardModel(rm_type="dapo", reward_key="score").score_group(group("Answer: 3", label="three"))


# ---------------------------------------------------------------------------------------------- remote_rm


async def test_remote_rm_posts_each_sample_and_reads_the_answer() -> None:
    from tests.support.reward_server import serve

    with serve() as service:
        samples = group("3", "4", label="3")
        await RewardModel(rm_type="remote_rm", rm_url=service.url).score_group(samples)
        assert [sample.reward for sample in samples] == [1.0, 0.0]
        assert sorted(body["response"] for body in service.bodies) == ["3", "4"]
        assert service.bodies[0].keys() == {"prompt", "response", "label"}
        assert service.bodies[0]["prompt"] == "3 7 1=" and service.bodies[0]["label"] == "3"
        assert all("Authorization" not in headers for headers in service.headers)

        samples = group("7", "8", label="dict:7")
        await RewardModel(rm_type="remote_rm", rm_url=service.url, reward_key="score").score_group(samples)
        assert [sample.scalar_reward("score") for sample in samples] == [1.0, -1.0]


async def test_remote_rm_retries_5xx_and_refuses_4xx_at_once() -> None:
    from coordinator.engines.policy import RetryPolicy
    from coordinator.rollout.remote_rm import RemoteReward
    from tests.support.reward_server import serve

    quick = RetryPolicy(attempts=5, backoff=0.01, backoff_max=0.05, budget=5.0)
    with serve() as service:
        remote = RemoteReward(service.url, timeout=5.0, retry=quick)
        samples = group("3", label="flaky:2:3")
        await RewardModel(rm_type="remote_rm", rm_url=service.url, remote=remote).score_group(samples)
        assert samples[0].reward == 1.0 and service.per_label["flaky:2:3"] == 3, "two 503s, then the answer"

        with pytest.raises(RewardError, match=r"--rm-url .*/score refused sample 0/0: HTTP 400: label refused by "
                                              r"the reward service"):
            await RewardModel(rm_type="remote_rm", rm_url=service.url, remote=remote).score_group(
                group("3", label="refuse"))
        assert service.per_label["refuse"] == 1, "a 4xx is not retried"

        with pytest.raises(RewardError, match=r"--rm-url .* failed sample 0/0: .*HTTP 503"):
            await RewardModel(rm_type="remote_rm", rm_url=service.url, remote=remote).score_group(
                group("3", label="flaky:99:3"))
        assert service.per_label["flaky:99:3"] == 5, "retried within the policy's attempts"
        closed_url = service.url
    with pytest.raises(RewardError, match=r"--rm-url .*: no answer for sample 0/0 within the retry budget"):
        await RemoteReward(closed_url, timeout=1.0, retry=RetryPolicy(attempts=2, backoff=0.01,
                                                                      budget=2.0)).score(group("3"))


def test_remote_rm_flags_are_checked_at_start_up() -> None:
    from coordinator.config import ConfigError, parse_config

    base = ["--hf-checkpoint", "/m", "--rollout-num-engines", "1", "--prompt-data", "builtin:first_digit",
            "--num-rollout", "1", "--rollout-batch-size", "1"]
    with pytest.raises(ConfigError, match=r"--rm-type remote_rm needs --rm-url"):
        parse_config([*base, "--rm-type", "remote_rm"])
    with pytest.raises(ConfigError, match=r"--rm-url: 'ftp://x/score' is not a URL"):
        parse_config([*base, "--rm-type", "remote_rm", "--rm-url", "ftp://x/score"])
    with pytest.raises(ConfigError, match=r"--rm-type dapo returns a dict reward .*--reward-key score"):
        parse_config([*base, "--rm-type", "dapo"])
    config = parse_config([*base, "--rm-type", "remote_rm", "--rm-url", "http://127.0.0.1:8000/score"])
    assert config.rollout.rm_url == "http://127.0.0.1:8000/score"
