"""TrainingLoop against small in-process implementations of its protocols (source, trainer, syncer, swap,
hooks, phases): the order of a run's calls, the weight versions, resume, and that every save has one owner."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from coordinator.config import CheckpointConfig, RolloutConfig
from coordinator.loop import TrainingLoop
from coordinator.observe.progress import MetricsLog
from replay.sample import RolloutBatch, Sample

pytestmark = pytest.mark.anyio


@dataclass
class Calls:
    """Every protocol call, in order, as (who, what, rollout id or version)."""

    log: list[tuple[str, str, Any]] = field(default_factory=list)

    def add(self, who: str, what: str, value: Any = None) -> None:
        self.log.append((who, what, value))

    def of(self, what: str) -> list[Any]:
        return [value for _, name, value in self.log if name == what]


class ListSource:
    """Rollout source: one group of two samples per id, each stamped with the version it was asked at."""

    def __init__(self, calls: Calls) -> None:
        self.calls = calls
        self.state: dict[str, Any] = {"next": 0}

    async def get_rollout(self, rollout_id: int, weight_version: str) -> RolloutBatch:
        self.calls.add("source", "get", (rollout_id, weight_version))
        self.state = {"next": rollout_id + 1}
        samples = [
            Sample(
                group_index=0,
                sample_index=i,
                tokens=[1, 2, 3],
                response_length=1,
                reward=float(i),
                weight_versions=[weight_version],
            )
            for i in range(2)
        ]
        return RolloutBatch(rollout_id=rollout_id, groups=[samples])

    def state_dict(self) -> dict[str, Any]:
        return dict(self.state)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.calls.add("source", "load_state", dict(state))
        self.state = dict(state)


@dataclass
class Restored:
    rollout_id: int
    extra: dict[str, Any]


class RecordingTrainer:
    def __init__(self, calls: Calls, *, saved: dict[int, dict[str, Any]] | None = None) -> None:
        self.calls = calls
        self.saved: dict[int, dict[str, Any]] = saved if saved is not None else {}

    async def train(self, rollout_id: int, samples: list[Any]) -> dict[str, float]:
        self.calls.add("trainer", "train", rollout_id)
        return {"loss": 0.5 / (rollout_id + 1)}

    async def save(self, rollout_id: int, extra: dict[str, Any]) -> str:
        self.calls.add("trainer", "save", rollout_id)
        self.saved[rollout_id] = extra
        return f"ckpt/rollout_{rollout_id}"

    async def save_hf(self, directory: str) -> str:
        self.calls.add("trainer", "save_hf", directory)
        return directory

    async def load_checkpoint(self, path: Path) -> Restored:
        self.calls.add("trainer", "load", str(path))
        last = max(self.saved)
        return Restored(rollout_id=last, extra=self.saved[last])

    @property
    def recoveries(self) -> int:
        return 0


class RecordingSync:
    def __init__(self, calls: Calls) -> None:
        self.calls = calls

    async def update(self, version: str) -> dict[str, float]:
        self.calls.add("sync", "update", version)
        return {"sync/time_s": 0.0}


class RecordingSwap:
    def __init__(self, calls: Calls) -> None:
        self.calls = calls

    async def before_train(self, rollout_id: int, generate_s: float) -> dict[str, float]:
        self.calls.add("swap", "before_train", rollout_id)
        return {}

    async def during_train(self) -> None:
        self.calls.add("swap", "during_train")

    async def after_train(self, rollout_id: int, version: str, train_s: float) -> dict[str, float]:
        self.calls.add("swap", "after_train", rollout_id)
        return {}

    async def after_update(self) -> dict[str, float]:
        self.calls.add("swap", "after_update")
        return {}


class RecordingHook:
    def __init__(self, calls: Calls) -> None:
        self.calls = calls

    async def after_step(self, rollout_id: int, weight_version: str) -> None:
        self.calls.add("hook", "after_step", (rollout_id, weight_version))

    async def before_loop(self, start_rollout: int, weight_version: str) -> None:
        self.calls.add("phase", "before_loop", (start_rollout, weight_version))

    async def after_loop(self) -> None:
        self.calls.add("phase", "after_loop")


@pytest.fixture
def metrics(tmp_path: Path) -> Iterator[MetricsLog]:
    log = MetricsLog(tmp_path / "run")
    yield log
    log.close()


def written_rows(metrics: MetricsLog) -> list[dict[str, Any]]:
    metrics.close()
    return [json.loads(line) for line in metrics.path.read_text().splitlines()]


def make_loop(
    metrics: MetricsLog,
    tmp_path: Path,
    calls: Calls,
    *,
    num_rollout: int,
    save_interval: int | None = None,
    save: bool = True,
    save_hf: str | None = None,
    trainer: RecordingTrainer | None = None,
    resume_from: Path | None = None,
    swap: RecordingSwap | None = None,
    async_rollout: bool = False,
) -> TrainingLoop:
    hook = RecordingHook(calls)
    return TrainingLoop(
        rollout=dataclasses.replace(RolloutConfig(), async_rollout=async_rollout),
        checkpoint=dataclasses.replace(
            CheckpointConfig(),
            save=str(tmp_path / "ckpt") if save else None,
            save_interval=save_interval if save or save_hf else None,
            save_hf=save_hf,
        ),
        rollouts=ListSource(calls),
        trainer=trainer or RecordingTrainer(calls),
        weight_sync=RecordingSync(calls),
        metrics=metrics,
        num_rollout=num_rollout,
        resume_from=resume_from,
        hooks=[hook],
        phases=[hook],
        colocation=swap,
    )


@pytest.mark.parametrize(
    ("num_rollout", "interval", "saved"),
    [
        (4, 2, [1, 3]),  # the last rollout falls on the interval: saved once, not again at the end
        (4, 4, [3]),
        (5, 2, [1, 3, 4]),  # the last rollout off the interval: saved at the end
        (3, None, [2]),  # no interval: the final save alone
    ],
)
async def test_every_rollout_is_saved_at_most_once_and_the_last_always(
    metrics: MetricsLog, tmp_path: Path, num_rollout: int, interval: int | None, saved: list[int]
) -> None:
    calls = Calls()
    result = await make_loop(metrics, tmp_path, calls, num_rollout=num_rollout, save_interval=interval).run()
    assert calls.of("save") == saved
    assert result.saved == saved


async def test_no_save_without_a_save_directory(metrics: MetricsLog, tmp_path: Path) -> None:
    calls = Calls()
    result = await make_loop(metrics, tmp_path, calls, num_rollout=3, save=False).run()
    assert calls.of("save") == [] and result.saved == []


async def test_save_hf_writes_at_every_save_with_the_rollout_id_and_alone_without_save(
    metrics: MetricsLog, tmp_path: Path
) -> None:
    calls = Calls()
    await make_loop(metrics, tmp_path, calls, num_rollout=5, save_interval=2, save_hf="hf/{rollout_id}").run()
    saves = [(name, value) for _, name, value in calls.log if name.startswith("save")]
    # slime's order at each save: the checkpoint, then the Hugging Face directory of the same rollout
    assert saves == [("save", 1), ("save_hf", "hf/1"), ("save", 3), ("save_hf", "hf/3"), ("save", 4),
                     ("save_hf", "hf/4")]
    calls = Calls()
    result = await make_loop(metrics, tmp_path, calls, num_rollout=3, save=False, save_hf="hf").run()
    assert calls.of("save") == [] and calls.of("save_hf") == ["hf"] and result.saved == [2]


async def test_synchronous_order_and_weight_versions(metrics: MetricsLog, tmp_path: Path) -> None:
    calls = Calls()
    loop = make_loop(metrics, tmp_path, calls, num_rollout=3, save_interval=None)
    result = await loop.run()
    assert (result.rollouts, result.train_steps, loop.weight_version) == (3, 3, "3")
    names = [(who, what) for who, what, _ in calls.log]
    assert names[0] == ("phase", "before_loop")
    step = [("source", "get"), ("trainer", "train"), ("sync", "update"), ("hook", "after_step")]
    assert names[1:13] == step * 3
    assert names[13:] == [("phase", "after_loop"), ("trainer", "save")]  # evaluations drained, then saved
    # generate k at version k, sync to k + 1, the hook sees the synced version
    assert calls.of("get") == [(0, "0"), (1, "1"), (2, "2")]
    assert calls.of("update") == ["1", "2", "3"]
    assert calls.of("after_step") == [(0, "1"), (1, "2"), (2, "3")]
    assert [row["weight_version"] for row in written_rows(loop.metrics)] == ["1", "2", "3"]


async def test_resume_continues_after_the_checkpoint_with_its_data_order_and_weights(
    metrics: MetricsLog, tmp_path: Path
) -> None:
    first_calls = Calls()
    trainer = RecordingTrainer(first_calls)
    await make_loop(metrics, tmp_path, first_calls, num_rollout=2, save_interval=1, trainer=trainer).run()
    assert sorted(trainer.saved) == [0, 1]

    calls = Calls()
    resumed_trainer = RecordingTrainer(calls, saved=trainer.saved)
    loop = make_loop(
        metrics,
        tmp_path,
        calls,
        num_rollout=4,
        save_interval=None,
        trainer=resumed_trainer,
        resume_from=tmp_path / "ckpt",
    )
    result = await loop.run()
    assert result.start_rollout == 2 and result.train_steps == 2
    assert calls.log[0] == ("trainer", "load", str(tmp_path / "ckpt"))
    assert calls.log[1] == ("source", "load_state", {"next": 2})
    assert calls.log[2] == ("sync", "update", "2")  # the restored weights reach the engines first
    assert calls.log[3] == ("phase", "before_loop", (2, "2"))
    assert calls.of("get") == [(2, "2"), (3, "3")]
    assert calls.of("save") == [3]


async def test_colocated_step_saves_before_the_ranks_offload(metrics: MetricsLog, tmp_path: Path) -> None:
    calls = Calls()
    await make_loop(metrics, tmp_path, calls, num_rollout=2, save_interval=1, swap=RecordingSwap(calls)).run()
    # during_train runs beside the train call (its order against it is the scheduler's)
    names = [(who, what) for who, what, _ in calls.log if who != "phase" and what != "during_train"]
    one_step = [
        ("source", "get"),
        ("swap", "before_train"),
        ("trainer", "train"),
        ("trainer", "save"),
        ("swap", "after_train"),
        ("sync", "update"),
        ("swap", "after_update"),
        ("hook", "after_step"),
    ]
    assert names == one_step * 2  # the last rollout was saved inside its step: no second save
    assert len(calls.of("during_train")) == 2


async def test_async_rollout_generates_the_next_rollout_within_the_staleness_bound(
    metrics: MetricsLog, tmp_path: Path
) -> None:
    calls = Calls()
    loop = make_loop(metrics, tmp_path, calls, num_rollout=4, save=False, async_rollout=True)
    result = await loop.run()
    assert result.train_steps == 4
    gets = calls.of("get")
    assert [rollout_id for rollout_id, _ in gets] == [0, 1, 2, 3]
    for rollout_id, version in gets:  # --max-weight-staleness 1 (the default)
        assert rollout_id - int(version) <= 1


async def test_a_failing_train_step_ends_the_loop_before_any_save_or_sync(
    metrics: MetricsLog, tmp_path: Path
) -> None:
    calls = Calls()

    class FailingTrainer(RecordingTrainer):
        async def train(self, rollout_id: int, samples: list[Any]) -> dict[str, float]:
            if rollout_id == 1:
                raise RuntimeError("rank 0 failed")
            return await super().train(rollout_id, samples)

    loop = make_loop(
        metrics, tmp_path, calls, num_rollout=3, save_interval=None, trainer=FailingTrainer(calls)
    )
    with pytest.RaisesGroup(pytest.RaisesExc(RuntimeError, match="rank 0 failed"), flatten_subgroups=True):
        await loop.run()
    assert calls.of("update") == ["1"] and calls.of("save") == []
    assert [row["weight_version"] for row in written_rows(loop.metrics)] == ["1"]
