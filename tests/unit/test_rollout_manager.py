"""Construction gates of the RolloutManager, counted per mode (not assumed)."""

from __future__ import annotations

import socket
from pathlib import Path

import psutil
import pytest

from coordinator.config import parse_config
from coordinator.rollout.manager import NotBuiltError, RolloutManager
from replay.format import dump_path, write_dump
from replay.sample import Sample, SampleStatus
from tests.support import rollout_fns

BASE = ["--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--num-rollout", "2",
        "--prompt-data", "builtin:first_digit"]


def _config(model: Path, *extra: str):
    return parse_config(["--hf-checkpoint", str(model), *BASE, *extra])


def _write_dumps(template: str, rollout_ids: range) -> None:
    for rollout_id in rollout_ids:
        samples = [
            Sample(group_index=g, sample_index=k, prompt="3 1 4=", tokens=[8, 4, 3, 4, 6, 18, 8, 8],
                   response_length=2, loss_mask=[1, 1], rollout_log_probs=[-0.25, -1.5], reward=float(k),
                   status=SampleStatus.COMPLETED, weight_versions=[str(rollout_id)], label="3")
            for g in range(2) for k in range(2)
        ]
        write_dump(dump_path(template, rollout_id), rollout_id, samples, config_facts={"n_samples_per_prompt": 2})


def _engine_sockets() -> list[object]:
    return [c for c in psutil.Process().net_connections(kind="inet") if c.status == psutil.CONN_ESTABLISHED]


async def test_replay_mode_builds_only_the_replay_loader_and_opens_nothing(tmp_path: Path) -> None:
    template = str(tmp_path / "dumps" / "{rollout_id}.rld")
    _write_dumps(template, range(2))
    config = _config(tmp_path, "--load-debug-rollout-data", template, "--use-fault-tolerance")
    children_before = psutil.Process().children(recursive=True)
    sockets_before = _engine_sockets()

    manager = RolloutManager.build(config)  # no client, no fleet: replay must not need them
    counts = manager.counts
    assert (counts["rollout_fns"], counts["eval_fns"], counts["generate_states"], counts["dispatchers"],
            counts["data_sources"], counts["replay_loaders"]) == (0, 0, 0, 0, 0, 1)
    assert manager.context is None and manager.built_generate_state is None
    for piece in ("rollout_fn", "eval_fn"):
        with pytest.raises(NotBuiltError, match="--load-debug-rollout-data"):
            getattr(manager, piece)

    batch = await manager.get_rollout(1, "1")
    assert batch.rollout_id == 1 and len(batch.groups) == 2
    # advantages are computed on the coordinator for replayed batches too (GRPO: rewards 0, 1 → -, +)
    assert [round(s.advantage, 3) for s in batch.groups[0]] == [-0.707, 0.707]
    assert psutil.Process().children(recursive=True) == children_before
    assert _engine_sockets() == sockets_before


async def test_debug_train_only_builds_the_rollout_fn_but_no_generate_state(tmp_path: Path) -> None:
    rollout_fns.CONSTRUCTED.clear()
    config = _config(tmp_path, "--debug-train-only", "--rollout-function-path", "tests.support.rollout_fns:CountingRollout")
    manager = RolloutManager.build(config)
    assert manager.counts["rollout_fns"] == 1 and manager.counts["generate_states"] == 0
    assert manager.counts["dispatchers"] == 0 and manager.counts["replay_loaders"] == 0
    assert rollout_fns.CONSTRUCTED == ["CountingRollout"]  # one instance serves rollout and eval
    assert manager.eval_fn is manager.rollout_fn
    with pytest.raises(NotBuiltError, match="--debug-train-only"):
        _ = manager.context.generate_state  # type: ignore[union-attr]
    with pytest.raises(NotBuiltError, match="--load-debug-rollout-data"):
        _ = manager.replay_loader
    batch = await manager.get_rollout(0, "0")  # the SFT-style producer still produces data
    assert len(batch.samples) == 4 and batch.samples[0].weight_versions == ["0"]


async def test_default_rollout_fn_in_train_only_mode_fails_clearly_when_called(tmp_path: Path) -> None:
    manager = RolloutManager.build(_config(tmp_path, "--debug-train-only"))
    assert manager.counts["rollout_fns"] == 1
    with pytest.raises(NotBuiltError, match=r"GenerateState .* --debug-train-only starts no engines"):
        await manager.get_rollout(0, "0")


def test_distinct_eval_fn_gets_its_own_instance(tmp_path: Path) -> None:
    rollout_fns.CONSTRUCTED.clear()
    config = _config(tmp_path, "--debug-train-only", "--rollout-function-path", "tests.support.rollout_fns:CountingRollout",
                     "--eval-function-path", "tests.support.rollout_fns.OtherCountingRollout")
    manager = RolloutManager.build(config)
    assert rollout_fns.CONSTRUCTED == ["CountingRollout", "OtherCountingRollout"]
    assert manager.counts["eval_fns"] == 1 and manager.eval_fn is not manager.rollout_fn


async def test_plain_function_rollout_is_called_with_the_context(tmp_path: Path) -> None:
    rollout_fns.CONSTRUCTED.clear()
    config = _config(tmp_path, "--debug-train-only", "--rollout-function-path", "tests.support.rollout_fns:plain_function_rollout")
    manager = RolloutManager.build(config)
    batch = await manager.get_rollout(3, "0")
    assert batch.rollout_id == 3 and rollout_fns.CONSTRUCTED == ["plain"]


def test_generating_mode_refuses_to_build_without_engines(tmp_path: Path) -> None:
    config = _config(tmp_path, "--rollout-num-engines", "1")
    with pytest.raises(ValueError, match="engine client"):
        RolloutManager.build(config)


def test_replay_dump_missing_names_file_and_template(tmp_path: Path) -> None:
    template = str(tmp_path / "{rollout_id}.rld")
    manager = RolloutManager.build(_config(tmp_path, "--load-debug-rollout-data", template))
    import anyio

    with pytest.raises(Exception, match=r"0\.rld") as info:
        anyio.run(manager.get_rollout, 0, "0")
    assert "{rollout_id}" in str(info.value)
    socket.socket  # noqa: B018 - the module is imported for the socket checks above


async def test_a_miles_class_with_a_sync_call_is_built_with_its_input_record_and_called_with_miles_inputs(
    tmp_path: Path
) -> None:
    """miles' class form: `cls(RolloutFnConstructorInput(args, data_source))`, called with
    `RolloutFnTrainInput(rollout_id, weight_version)` / `RolloutFnEvalInput(...)`, a plain `__call__` run in a
    worker thread; one instance serves eval when the paths are equal."""
    from coordinator.hooks import RolloutFnEvalInput, RolloutFnTrainInput
    from coordinator.rollout.miles_rollout_fn import MilesRolloutFn
    from coordinator.rollout.slime_rollout_fn import eval_metrics
    from tests.support.miles_rollout_fns import SyncFixedRolloutFn

    SyncFixedRolloutFn.INPUTS.clear()
    path = "tests.support.miles_rollout_fns:SyncFixedRolloutFn"
    manager = RolloutManager.build(_config(tmp_path, "--debug-train-only", "--rollout-function-path", path,
                                           "--eval-function-path", path))
    assert isinstance(manager.rollout_fn, MilesRolloutFn) and manager.eval_fn is manager.rollout_fn
    assert manager.rollout_fn.instance.args.rollout_batch_size == 2  # the hooks' args, slime's names
    batch = await manager.get_rollout(4, "3")
    result = await manager.rollout_fn.evaluate(5, "3")
    assert SyncFixedRolloutFn.INPUTS == [RolloutFnTrainInput(rollout_id=4, weight_version=3),
                                         RolloutFnEvalInput(rollout_id=5, weight_version="3")]
    assert batch.rollout_id == 4 and [s.reward for s in batch.samples] == [0.0, 1.0]
    assert batch.metrics == {"fixed/groups": 1.0}
    assert eval_metrics(result) == {"eval/fixed": 0.5, "eval/fixed-none_reward_ratio": 0.5,
                                    "eval/fixed-truncated_ratio": 0.5}
