"""The replay loader: same interface as the generate path, groups rebuilt, deterministic subsampling."""

from __future__ import annotations

from pathlib import Path

import pytest

from replay.format import DumpError, dump_path, write_dump
from replay.loader import ReplayLoader, ReplayMissingError, group_samples, subsample_groups
from replay.sample import RolloutBatch, Sample, SampleStatus


def sample(group: int, index: int) -> Sample:
    return Sample(
        group_index=group,
        sample_index=index,
        prompt=f"p{group}",
        tokens=[1, 2, 3 + index],
        response_length=1,
        loss_mask=[1],
        rollout_log_probs=[-0.5 - index],
        reward=float(index),
        status=SampleStatus.COMPLETED,
        weight_versions=["1"],
    )


def write_rollout(template: str, rollout_id: int, groups: list[int], n: int = 2) -> Path:
    samples = [sample(g, i) for g in groups for i in range(n)]
    return write_dump(
        dump_path(template, rollout_id), rollout_id, samples, config_facts={"n_samples_per_prompt": n}
    )


@pytest.fixture
def template(tmp_path: Path) -> str:
    return str(tmp_path / "dumps" / "{rollout_id}.rld")


async def test_get_rollout_returns_groups_in_file_order(template: str) -> None:
    # Groups written out of index order (as an over-sampling generate path accepts them) stay in that order.
    write_rollout(template, 0, [5, 2, 9])
    loader = ReplayLoader(template, subsample=None, seed=1, n_samples_per_prompt=2)
    batch = await loader.get_rollout(0, "weights-7")
    assert isinstance(batch, RolloutBatch)
    assert batch.rollout_id == 0
    assert [[(s.group_index, s.sample_index) for s in g] for g in batch.groups] == [
        [(5, 0), (5, 1)],
        [(2, 0), (2, 1)],
        [(9, 0), (9, 1)],
    ]
    assert batch.samples[1].rollout_log_probs == [-1.5]
    assert batch.metrics["replay/samples"] == 6.0


async def test_dumped_metrics_come_back(template: str) -> None:
    samples = [sample(0, 0), sample(0, 1)]
    facts = {"metrics": {"rollout/raw_reward": 0.5, "rollout/response_len/mean": 12, "note": "text",
                         "rollout/time_s": 3.5, "rollout/tokens_per_s": 900.0}}
    write_dump(dump_path(template, 2), 2, samples, config_facts=facts)
    batch = await ReplayLoader(template, subsample=None, seed=0, n_samples_per_prompt=2).get_rollout(2, "1")
    assert batch.metrics["rollout/raw_reward"] == 0.5
    assert batch.metrics["rollout/response_len/mean"] == 12.0
    assert "note" not in batch.metrics
    # the generating run's timings are not the replay's: it generated nothing (no "gen" time on its line)
    assert "rollout/time_s" not in batch.metrics and "rollout/tokens_per_s" not in batch.metrics


def test_group_samples_interleaved() -> None:
    mixed = [sample(1, 0), sample(0, 0), sample(1, 1), sample(0, 1)]
    assert [[s.sample_index for s in g] for g in group_samples(mixed)] == [[0, 1], [0, 1]]
    assert [g[0].group_index for g in group_samples(mixed)] == [1, 0]


async def test_subsample_is_deterministic_and_keeps_whole_groups(template: str) -> None:
    groups = list(range(20))
    for rollout_id in (0, 1):
        write_rollout(template, rollout_id, groups, n=3)
    first = ReplayLoader(template, subsample=0.25, seed=42, n_samples_per_prompt=3)
    second = ReplayLoader(template, subsample=0.25, seed=42, n_samples_per_prompt=3)
    other_seed = ReplayLoader(template, subsample=0.25, seed=43, n_samples_per_prompt=3)

    def chosen(batch: RolloutBatch) -> list[int]:
        assert all(len(g) == 3 and len({s.group_index for s in g}) == 1 for g in batch.groups)
        return [g[0].group_index for g in batch.groups]

    a0 = chosen(await first.get_rollout(0, "1"))
    assert a0 == chosen(await second.get_rollout(0, "1"))  # same seed, same rollout → same groups
    assert len(a0) == 5 and a0 == sorted(a0)  # round(0.25 * 20), file order kept
    a1 = chosen(await first.get_rollout(1, "1"))
    b0 = chosen(await other_seed.get_rollout(0, "1"))
    # Different rollout ids or seeds pick different subsets (fixed seeds: this is not a flaky chance).
    assert a1 != a0 and b0 != a0
    batch = await first.get_rollout(0, "1")
    assert batch.metrics["replay/groups"] == 5.0 and batch.metrics["replay/groups_in_dump"] == 20.0


def test_subsample_bounds() -> None:
    groups = [[sample(g, 0)] for g in range(3)]
    assert len(subsample_groups(groups, 0.01, seed=0, rollout_id=0)) == 1  # never an empty batch
    assert subsample_groups(groups, 1.0, seed=0, rollout_id=0) == groups
    with pytest.raises(ValueError, match=r"subsample must be in \(0, 1\], got 1.5"):
        ReplayLoader("d/{rollout_id}.rld", subsample=1.5, seed=0, n_samples_per_prompt=None)
    with pytest.raises(ValueError, match=r"must be in \(0, 1\], got 0"):
        subsample_groups(groups, 0, seed=0, rollout_id=0)


async def test_missing_file_names_file_and_template(template: str) -> None:
    write_rollout(template, 0, [0])
    write_rollout(template, 1, [0])
    loader = ReplayLoader(template, subsample=None, seed=0, n_samples_per_prompt=2)
    with pytest.raises(ReplayMissingError) as info:
        await loader.get_rollout(3, "1")
    message = str(info.value)
    assert str(dump_path(template, 3)) in message
    assert repr(template) in message
    assert "dumps found for rollout ids 0, 1" in message
    assert isinstance(info.value, DumpError)


def test_template_without_placeholder() -> None:
    with pytest.raises(DumpError, match=r"no \{rollout_id\} placeholder"):
        ReplayLoader("/tmp/dump.rld", subsample=None, seed=0, n_samples_per_prompt=None)


async def test_group_size_and_header_mismatch(template: str) -> None:
    write_rollout(template, 0, [0, 1], n=2)
    with pytest.raises(DumpError, match="dumped with n_samples_per_prompt=2, but this run has"):
        await ReplayLoader(template, subsample=None, seed=0, n_samples_per_prompt=4).get_rollout(0, "1")
    # A dump with a short group (and no header fact) is refused when the run expects full groups.
    write_dump(dump_path(template, 1), 1, [sample(0, 0), sample(0, 1), sample(1, 0)], config_facts={})
    with pytest.raises(
        DumpError, match=r"1 group\(s\) do not hold --n-samples-per-prompt 2 samples.*\(1, 1\)"
    ):
        await ReplayLoader(template, subsample=None, seed=0, n_samples_per_prompt=2).get_rollout(1, "1")
    # Without n_samples_per_prompt the loader serves it as it is.
    batch = await ReplayLoader(template, subsample=None, seed=0, n_samples_per_prompt=None).get_rollout(
        1, "1"
    )
    assert [len(g) for g in batch.groups] == [2, 1]


async def test_renamed_or_eval_dump_is_refused(template: str) -> None:
    write_rollout(template, 5, [0])
    dump_path(template, 5).rename(dump_path(template, 6))
    loader = ReplayLoader(template, subsample=None, seed=0, n_samples_per_prompt=None)
    with pytest.raises(DumpError, match="header says rollout 5 but the template maps it to rollout 6"):
        await loader.get_rollout(6, "1")
    write_dump(dump_path(template, 7), 7, [sample(0, 0)], config_facts={}, kind="eval")
    with pytest.raises(DumpError, match="is an eval dump, not a rollout dump"):
        await loader.get_rollout(7, "1")


def test_available_rollout_ids_skips_eval_and_strangers(tmp_path: Path) -> None:
    template = str(tmp_path / "run[1]" / "r_{rollout_id}.rld")  # glob metacharacters in the directory
    for rollout_id in (3, 10, 0):
        write_rollout(template, rollout_id, [0])
    write_dump(dump_path(template, 4, eval=True), 4, [sample(0, 0)], config_facts={}, kind="eval")
    (Path(template).parent / "r_x.rld").write_bytes(b"not a dump")
    loader = ReplayLoader(template, subsample=None, seed=0, n_samples_per_prompt=None)
    assert loader.available_rollout_ids() == [0, 3, 10]


def test_state_dict_is_trivial() -> None:
    loader = ReplayLoader("d/{rollout_id}.rld", subsample=0.5, seed=9, n_samples_per_prompt=None)
    state = loader.state_dict()
    assert state == {"kind": "replay", "seed": 9, "subsample": 0.5}
    loader.load_state_dict({"epoch": 3, "offset": 17})  # a generate-path data source's state is accepted
    assert loader.state_dict() == state
