"""Checkpoints on disk, in one process: a re-save of the same rollout keeps `latest` on a complete checkpoint
whatever step a crash interrupts, the next save finishes the interrupted one, and a damaged `latest` is refused
with the list of complete checkpoints and the flag that picks one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from workers.train_rank import checkpoint as ckpt

# one process, no process group: DCP says it saves and loads for a single process, which is what this is
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


class State:
    """A model, optimizer and scheduler whose parameters are all `value` (so a load shows which was saved)."""

    def __init__(self, value: float = 0.0) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Linear(4, 3)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda step: 1.0)
        self.model(torch.ones(2, 4)).sum().backward()
        self.optimizer.step()
        self.scheduler.step()
        with torch.no_grad():
            for parameter in self.model.parameters():
                parameter.fill_(value)

    def objects(self) -> dict[str, object]:
        return {"model": self.model, "optimizer": self.optimizer, "scheduler": self.scheduler}

    @property
    def value(self) -> float:
        return float(self.model.weight[0, 0].detach())


def save(save_dir: Path, rollout_id: int, value: float) -> Path:
    return ckpt.save_checkpoint(save_dir, rollout_id, extra={"value": value}, **State(value).objects())


def load(path: Path) -> tuple[ckpt.LoadedCheckpoint, float]:
    state = State()
    loaded = ckpt.load_checkpoint(path, **state.objects())  # type: ignore[arg-type]
    return loaded, state.value


def crash_during_resave(save_dir: Path, rollout_id: int, value: float, steps_done: int) -> None:
    """CRASH simulation (a crash at a chosen instant cannot be produced on demand): a save of `rollout_id`
    writes its complete tmp directory, then publishes it but stops after `steps_done` of its steps, as if
    the process died there."""
    state = State(value)
    ckpt.write_tmp(save_dir, rollout_id, extra={"value": value}, **state.objects())  # type: ignore[arg-type]
    for step in ckpt.publish_steps(save_dir, rollout_id)[:steps_done]:
        step()


RESAVE_STEPS = 5


def test_a_resave_has_the_steps_the_crash_test_interrupts(tmp_path: Path) -> None:
    save(tmp_path, 5, 1.0)
    ckpt.write_tmp(tmp_path, 5, extra={}, **State(2.0).objects())  # type: ignore[arg-type]
    assert len(ckpt.publish_steps(tmp_path, 5)) == RESAVE_STEPS


@pytest.mark.parametrize("steps_done", range(RESAVE_STEPS + 1))
def test_a_crash_at_any_step_of_a_resave_still_resumes(tmp_path: Path, steps_done: int) -> None:
    save(tmp_path, 3, 1.0)
    save(tmp_path, 5, 2.0)
    crash_during_resave(tmp_path, 5, 3.0, steps_done)

    named = json.loads((tmp_path / ckpt.LATEST).read_text())
    assert ckpt.is_complete(tmp_path / named), f"after {steps_done} steps latest names {named}, not complete"
    loaded, value = load(tmp_path)
    assert loaded.rollout_id == 5
    # before the first step `latest` still names the first save of rollout 5; from it on, the new one
    assert value == (2.0 if steps_done == 0 else 3.0) and loaded.extra == {"value": value}

    # the next save finishes the interrupted publish first and leaves nothing behind
    save(tmp_path, 6, 4.0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "rollout_3", "rollout_5", "rollout_6"]
    loaded, value = load(tmp_path / "rollout_5")
    assert value == (2.0 if steps_done == 0 else 3.0)
    assert load(tmp_path)[1] == 4.0


def test_a_resave_of_the_same_rollout_replaces_it(tmp_path: Path) -> None:
    save(tmp_path, 5, 1.0)
    save(tmp_path, 5, 2.0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "rollout_5"]
    assert load(tmp_path)[1] == 2.0


@pytest.mark.parametrize("latest", ['"rollout_7"', "not json", None, '"../../../../etc"', "\x00\xff\xfe",
                                    '"tmp-7"', "[" * 100_000])
def test_a_damaged_latest_is_refused_with_the_complete_checkpoints_and_the_flag(
    tmp_path: Path, latest: str | None
) -> None:
    """`latest` naming a directory that is gone, a partial one, one outside, garbage or nothing: the load
    refuses instead of picking a checkpoint for the user, and says which are complete and how to pick one."""
    save(tmp_path, 3, 1.0)
    save(tmp_path, 5, 2.0)
    partial = tmp_path / "tmp-7"
    save(tmp_path / "other", 7, 9.0)
    (tmp_path / "other" / "rollout_7").rename(partial)
    (partial / "manifest.json").unlink()  # a save of rollout 7 that did not finish
    if latest is None:
        (tmp_path / ckpt.LATEST).unlink()
    else:
        (tmp_path / ckpt.LATEST).write_text(latest)
    with pytest.raises(ckpt.CheckpointError) as refused:
        load(tmp_path)
    message = str(refused.value)
    assert str(tmp_path / ckpt.LATEST) in message and "refusing to guess" in message
    assert "complete checkpoints: rollout 3, 5: pick one with --ckpt-step N (e.g. --ckpt-step 5)" in message
    loaded, value = load_step(tmp_path, 3)
    assert loaded.rollout_id == 3 and value == 1.0


def load_step(path: Path, step: int) -> tuple[ckpt.LoadedCheckpoint, float]:
    state = State()
    loaded = ckpt.load_checkpoint(path, step=step, **state.objects())  # type: ignore[arg-type]
    return loaded, state.value


def test_nothing_complete_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / ckpt.LATEST).write_text('"rollout_1"')
    with pytest.raises(ckpt.CheckpointError, match=r"names rollout_1, which is not a complete checkpoint.*holds no"):
        ckpt.resolve_checkpoint(tmp_path)
    with pytest.raises(ckpt.CheckpointError, match="neither a checkpoint directory nor a save dir"):
        ckpt.resolve_checkpoint(tmp_path / "nowhere")
    with pytest.raises(ckpt.CheckpointError, match="no complete checkpoint of rollout 4"):
        ckpt.resolve_checkpoint(tmp_path, 4)


#: what a save leaves in `tmp-<id>` when it is killed before its end: each file it writes, in order
WRITE_PHASES = ["__0_0.distcp", ".metadata", "rng_rank0.json", "scheduler.json", "extra.json", "manifest.json"]


@pytest.mark.parametrize("written", range(len(WRITE_PHASES) + 1))
def test_a_save_killed_while_writing_or_before_its_publish_is_never_resumed_from(tmp_path: Path,
                                                                                 written: int) -> None:
    """CRASH simulation (a kill at a chosen instant cannot be produced on demand): a save of rollout 5
    stopped after writing `written` of its files — or complete but not published, as a save the ranks
    finish after the coordinator died (it publishes only once the step's metrics row is written)."""
    save(tmp_path, 3, 1.0)
    tmp = ckpt.save_checkpoint(tmp_path, 5, extra={}, publish=False, **State(2.0).objects())
    assert tmp == tmp_path / "tmp-5" and ckpt.is_complete(tmp)
    for name in WRITE_PHASES[written:]:
        (tmp / name).unlink()
    assert json.loads((tmp_path / ckpt.LATEST).read_text()) == "rollout_3"
    loaded, value = load(tmp_path)
    assert loaded.rollout_id == 3 and value == 1.0
    if written < len(WRITE_PHASES):
        with pytest.raises(ckpt.CheckpointError, match="tmp-5: not a complete checkpoint to publish"):
            ckpt.publish_checkpoint(tmp_path, 5)
    save(tmp_path, 4, 4.0)  # the next save clears what the killed one left
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "rollout_3", "rollout_4"]


def test_the_coordinator_publishes_a_finished_save(tmp_path: Path) -> None:
    save(tmp_path, 3, 1.0)
    ckpt.save_checkpoint(tmp_path, 5, extra={}, publish=False, **State(2.0).objects())
    assert ckpt.publish_checkpoint(tmp_path, 5, retain_interval=2) == tmp_path / "rollout_5"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "rollout_5"]  # 3 pruned (not a multiple)
    assert load(tmp_path)[1] == 2.0
