"""Built-in rewards (incl. the math checker), the reward router with custom rms, and hook loading."""

from __future__ import annotations

import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import anyio
import anyio.lowlevel
import pytest

from coordinator.rollout.loading import HookLoadError, load_object
from coordinator.rollout.rewards import (
    RewardError,
    RewardModel,
    char_match_reward,
    exact_match_reward,
    extract_boxed,
    extract_math_answer,
    first_digit_reward,
    math_reward,
)
from replay.sample import Sample, SampleStatus


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


# ---------------------------------------------------------------------------------------------- built-ins


def test_exact_match() -> None:
    assert exact_match_reward("  42\n", "42") == 1.0
    assert exact_match_reward("42.", "42") == 0.0
    assert exact_match_reward("", " ") == 1.0


@pytest.mark.parametrize(
    ("response", "reward"),
    [("3333", 1.0), ("3333333", 1.0), ("3x3y", 0.5), ("3", 0.25), ("", 0.0), ("1333", 0.75), (" 333", 0.75)],
)
def test_first_digit(response: str, reward: float) -> None:
    assert first_digit_reward(response, "3") == reward


def test_first_digit_needs_one_char_label() -> None:
    with pytest.raises(RewardError, match="one-character label"):
        first_digit_reward("3333", "33")


def test_char_match() -> None:
    assert char_match_reward("371=", "371") == 1.0
    assert char_match_reward("3", "371") == pytest.approx(1 / 3)
    assert char_match_reward("173", "371") == pytest.approx(1 / 3)
    assert char_match_reward("", "371") == 0.0


@pytest.mark.parametrize(
    ("text", "content"),
    [
        (r"so \boxed{42}.", "42"),
        (r"\boxed{1} then \boxed{\frac{1}{2}}", r"\frac{1}{2}"),
        (r"\boxed{\{1, 2\}}", r"\{1, 2\}"),
        (r"\boxed{a_{i}^{2}}", "a_{i}^{2}"),
        (r"\fbox{7}", "7"),
        (r"$\boxed 5$", "5"),
        (r"\boxed{12", None),
        ("no box", None),
    ],
)
def test_extract_boxed(text: str, content: str | None) -> None:
    assert extract_boxed(text) == content


def test_extract_math_answer_prefers_boxed_then_last_number() -> None:
    assert extract_math_answer(r"we get 3, then \boxed{17} and 99") == "17"
    assert extract_math_answer("first 12 then 1,234.5 apples") == "1,234.5"
    assert extract_math_answer("The answer is -7.") == "-7"
    assert extract_math_answer("nothing numeric") is None


@pytest.mark.parametrize(
    ("response", "label", "reward"),
    [
        (r"The answer is \boxed{42}.", "42", 1.0),
        (r"\boxed{42}", "41", 0.0),
        (r"... \boxed{\frac{1}{2}}", "0.5", 1.0),
        (r"\boxed{\dfrac{3}{4}}", "3/4", 1.0),
        (r"\boxed{\frac12}", "1/2", 1.0),
        (r"\boxed{-\frac{2}{4}}", "-0.5", 1.0),
        (r"\boxed{1,000}", "1000", 1.0),
        ("So the total is 1,234,567 dollars.", "1234567", 1.0),
        (r"\boxed{50\%}", "0.5", 1.0),
        ("about 50%", "50", 1.0),
        (r"\boxed{x = 7}", "7", 1.0),
        (r"\boxed{7.0}", "7", 1.0),
        (r"\boxed{3.14}", "3.15", 0.0),
        (r"\boxed{0.3333333}", "1/3", 1.0),
        (r"\boxed{0.33}", "1/3", 0.0),
        (r"\boxed{2}", r"\boxed{2}", 1.0),
        (r"\boxed{$12$}", "12", 1.0),
        (r"\boxed{90^\circ}", "90", 1.0),
        (r"\boxed{\text{(B)}}", "(B)", 1.0),
        (r"\boxed{\sqrt{2}}", r"\sqrt{2}", 1.0),
        (r"\boxed{\sqrt{3}}", r"\sqrt{2}", 0.0),
        ("we tried 3 and then 5", "5", 1.0),
        ("we tried 5 and then 3", "5", 0.0),
        (r"first \boxed{5} then \boxed{6}", "6", 1.0),
        ("no answer at all", "5", 0.0),
        (r"\boxed{}", "5", 0.0),
        (r"\boxed{1/0}", "1/0", 1.0),  # not a number on either side: compared as text
        ("2e3", "2000", 1.0),
    ],
)
def test_math_reward(response: str, label: str, reward: float) -> None:
    assert math_reward(response, label) == reward


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
        RewardError, match=r"--rm-type 'f1' is not a built-in reward; known: char_match, exact_match"
    ):
        RewardModel(rm_type="f1")
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


def test_math_reward_survives_hostile_responses() -> None:
    # Beyond int()'s digit limit and float range: not numbers, so compared as text (and no exception).
    assert math_reward("1" * 100_000, "1") == 0.0
    assert math_reward(r"\boxed{1e999999}", "1") == 0.0
    assert math_reward(r"\boxed{1e999999}", "1e999999") == 1.0
    # Thousands of unclosed boxes: the innermost closed one is the answer (found in one pass over the text).
    assert math_reward("\\boxed{" * 5_000 + "5}", "5") == 1.0
    assert math_reward("\\boxed{" * 5_000, "5") == 0.0
