"""HealthMonitor against real CPU engines (a SIGSTOPped engine mid-rollout) and a fake responder (slow vs hung,
an external engine that goes away and comes back)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import anyio

from coordinator.config import parse_config
from coordinator.engines.client import EngineClient
from coordinator.engines.fleet import EngineFleet, EngineState
from coordinator.engines.health import HealthMonitor
from coordinator.engines.launch import EngineLaunchSpec
from coordinator.rollout.manager import RolloutManager
from replay.sample import RolloutBatch, SampleStatus
from tests.support.fake_engine import FakeEngine


async def test_sigstopped_engine_is_marked_dead_within_the_bound_and_the_rollout_completes(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    spec = EngineLaunchSpec(kind="rayless", model_path=str(tiny_model_dir), stop_grace=1.0,
                            extra_args=("--weight-version", "0", "--random-seed", "0"),
                            env=(("RAYLESS_ENGINE_THREADS", "1"),))
    async with EngineClient(max_connections=64) as client, anyio.create_task_group() as group:
        fleet = EngineFleet(client=client, launch=spec, num_engines=2, run_dir=tmp_path, probe_timeout=2)
        await group.start(fleet.run)
        monitor = HealthMonitor(fleet=fleet, client=client, interval=0.5, timeout=1.0, failure_threshold=2)
        await group.start(monitor.run)
        config = parse_config(["--hf-checkpoint", str(tiny_model_dir), "--rollout-num-engines", "2",
                               "--prompt-data", "builtin:first_digit", "--num-rollout", "1",
                               "--rollout-batch-size", "8", "--n-samples-per-prompt", "2",
                               "--rollout-max-response-len", "32", "--sglang-server-concurrency", "8"])
        manager = RolloutManager.build(config, tokenizer=AutoTokenizer.from_pretrained(tiny_model_dir),
                                       client=client, pool=fleet, context_length=512)
        rollout_fn: Any = manager.rollout_fn.target  # type: ignore[attr-defined]
        victim = fleet.engines[0]
        result: list[RolloutBatch] = []
        stopped_at = 0.0

        async def rollout() -> None:
            result.append(await manager.get_rollout(0, "0"))

        async with anyio.create_task_group() as inner:
            inner.start_soon(rollout)
            with anyio.fail_after(60):
                while rollout_fn.progress is None or rollout_fn.progress.generated_tokens < 40:  # noqa: ASYNC110 - polls a counter another task owns
                    await anyio.sleep(0.02)
            assert victim.process is not None and victim.process.pid is not None
            os.killpg(victim.process.pid, signal.SIGSTOP)  # hung: the socket stays open, nothing answers
            stopped_at = time.monotonic()
            with anyio.fail_after(30):
                while not any(e.kind == "dead" for e in monitor.events):  # noqa: ASYNC110 - polls the monitor's log
                    await anyio.sleep(0.02)
        dead = next(e for e in monitor.events if e.kind == "dead")
        detection = dead.at - stopped_at
        print(f"hung engine detected after {detection:.2f}s; bound interval + timeout + interval = "
              f"{monitor.detection_bound:.2f}s")
        assert dead.engine == victim.name and "2 consecutive" in dead.detail
        # The requirement (interval + timeout + one interval), with 1.5 s allowance for a loaded CI box.
        assert detection <= monitor.detection_bound + 1.5
        batch = result[0]
        assert len(batch.groups) == 8 and all(len(g) == 2 for g in batch.groups)
        assert all(s.status in (SampleStatus.COMPLETED, SampleStatus.TRUNCATED) for s in batch.samples)
        keys = [(s.metadata["prompt_index"], s.sample_index) for s in batch.samples]
        assert len(set(keys)) == len(keys), "no sample answered twice"
        # recovery (relaunch with the current weights) is exercised by tests/test_chaos.py; here it is enough
        # that the monitor began it: the hung engine left ALIVE and is being brought back
        assert victim.state is not EngineState.ALIVE or victim.incarnation == 2
        group.cancel_scope.cancel()


async def test_slow_is_not_hung_and_an_external_engine_is_waited_for(tmp_path: Path) -> None:
    """FAKE engine: a /health_generate that hangs while /metrics moves cannot be produced on demand for real."""
    fake = FakeEngine()
    async with EngineClient(max_connections=16) as client, anyio.create_task_group() as group:
        await group.start(fake.run)
        fleet = EngineFleet(client=client, external_urls=[fake.url], run_dir=tmp_path, probe_timeout=1)
        await group.start(fleet.run)
        monitor = HealthMonitor(fleet=fleet, client=client, interval=0.1, timeout=0.3, failure_threshold=2)
        await group.start(monitor.run)
        handle = fleet.engines[0]

        fake.health, fake.progressing = "hang", True  # overloaded: probes time out, requests keep finishing
        with anyio.fail_after(10):
            while monitor.stats.slow < 5:  # noqa: ASYNC110 - polls the monitor's counter
                await anyio.sleep(0.02)
        assert handle.state is EngineState.ALIVE and monitor.stats.deaths == 0

        fake.progressing = False  # hung: no progress any more
        with anyio.fail_after(10):
            while handle.state is EngineState.ALIVE:  # noqa: ASYNC110 - polls the fleet's state
                await anyio.sleep(0.02)
        assert monitor.stats.deaths == 1 and "no progress" in monitor.events[-1].detail

        fake.stop_serving()  # the external engine is gone; the monitor keeps probing, never launches it
        await anyio.sleep(0.5)
        assert handle.state is EngineState.DEAD and monitor.stats.recoveries == 0
        fake.health = "ok"
        fake.start_serving()
        with anyio.fail_after(10):
            while monitor.stats.recoveries < 1:  # noqa: ASYNC110 - polls the monitor's counter
                await anyio.sleep(0.02)
        assert handle.state is EngineState.ALIVE and handle.url == fake.url
        group.cancel_scope.cancel()


async def test_probing_pauses_while_weights_are_updated(tmp_path: Path) -> None:
    """FAKE engine that stops answering /health_generate during a (simulated) weight update: no fault then."""
    from coordinator.weights.sync import WeightSync

    fake = FakeEngine()
    async with EngineClient(max_connections=16) as client, anyio.create_task_group() as group:
        await group.start(fake.run)
        fleet = EngineFleet(client=client, external_urls=[fake.url], run_dir=tmp_path, probe_timeout=1)
        await group.start(fleet.run)
        weight_sync = WeightSync(mode="disk", fleet=fleet, client=client, trainer=None,  # type: ignore[arg-type]
                                 snapshot_dir=tmp_path, recover_engines=True)
        monitor = HealthMonitor(fleet=fleet, client=client, interval=0.1, timeout=0.2, failure_threshold=2,
                                recovery=weight_sync.recovery)
        await group.start(monitor.run)
        await anyio.sleep(0.3)
        weight_sync.updating = anyio.Event()  # what WeightSync.update() does while engines load weights
        fake.health = "hang"
        await anyio.sleep(1.0)
        assert monitor.stats.probe_failures == 0 and fleet.engines[0].state is EngineState.ALIVE
        probes_while_paused = monitor.stats.probes
        await anyio.sleep(0.5)
        assert monitor.stats.probes == probes_while_paused, "no probe starts during an update"
        weight_sync.updating.set()  # update done; the engine still hangs: now it is a fault
        with anyio.fail_after(10):
            while fleet.engines[0].state is EngineState.ALIVE:  # noqa: ASYNC110 - polls the fleet's state
                await anyio.sleep(0.02)
        assert monitor.stats.deaths == 1
        group.cancel_scope.cancel()


class SnapshotExporter:
    """Stand-in for the TrainGroup's `export_weights`: the fake engine accepts any snapshot directory."""

    def __init__(self) -> None:
        self.exports: list[str] = []

    async def export_weights(self, directory: Path, weight_version: str, keep: int = 2) -> Path:
        self.exports.append(weight_version)
        path = Path(directory) / f"weights-{weight_version}"
        await anyio.Path(path).mkdir(parents=True, exist_ok=True)
        return path


async def test_one_recovery_for_two_callers_loads_the_current_weights_before_dispatch(tmp_path: Path) -> None:
    """FAKE external engine that comes back with its start weights (restarted by whoever runs it): the monitor's
    recovery and the weight sync's are one, so two callers at once bring it back once, with the current
    version loaded from the snapshot the last update exported."""
    from coordinator.weights.sync import WeightSync

    fake = FakeEngine()
    async with EngineClient(max_connections=16) as client, anyio.create_task_group() as group:
        await group.start(fake.run)
        fleet = EngineFleet(client=client, external_urls=[fake.url], run_dir=tmp_path, probe_timeout=1,
                            attach_timeout=10)
        await group.start(fleet.run)
        exporter = SnapshotExporter()
        weight_sync = WeightSync(mode="disk", fleet=fleet, client=client, trainer=exporter,  # type: ignore[arg-type]
                                 snapshot_dir=tmp_path / "weights", recover_engines=True)
        await weight_sync.update("3")
        assert fake.weight_version == "3" and exporter.exports == ["3"]
        monitor = HealthMonitor(fleet=fleet, client=client, interval=0.1, timeout=0.5,
                                recovery=weight_sync.recovery)
        assert weight_sync in monitor.pauses

        handle = fleet.engines[0]
        fleet.mark_dead(handle, "the engine restarted")
        fake.weight_version = "0"  # back with the weights it starts from
        brought_back: list[bool] = []

        async def recover() -> None:
            brought_back.append(await monitor.recovery.recover(handle))

        async with anyio.create_task_group() as callers:
            callers.start_soon(recover)
            callers.start_soon(recover)
        assert sorted(brought_back) == [False, True], "the second caller waited and found it back"
        assert handle.state is EngineState.ALIVE and handle.incarnation == 2
        assert fake.weight_version == "3"
        assert fake.requests["/update_weights_from_disk"] == 2, "the update, then one load by the recovery"
        assert exporter.exports == ["3"], "the snapshot of the current version is reused, not exported again"
        group.cancel_scope.cancel()


class NoRanks:
    """FAKE training side of a colocation swap that only releases engines (`offload_train` off): it is asked
    for nothing but its recovery count."""

    recoveries = 0


async def test_a_released_engine_is_alive_and_the_swap_pauses_probing(tiny_model_dir: Path, tmp_path: Path) -> None:
    """A real CPU engine whose memory is released answers probes 503 MemoryReleased: counted as `released`,
    never as a failure; while a colocation swap has it released, no probe starts at all."""
    from coordinator.weights.colocate import Colocation

    spec = EngineLaunchSpec(kind="rayless", model_path=str(tiny_model_dir), stop_grace=1.0,
                            extra_args=("--weight-version", "0", "--random-seed", "0",
                                        "--weight-spill-dir", str(tmp_path / "spill")),
                            env=(("RAYLESS_ENGINE_THREADS", "1"),))
    async with EngineClient(max_connections=16) as client, anyio.create_task_group() as group:
        fleet = EngineFleet(client=client, launch=spec, num_engines=1, run_dir=tmp_path, probe_timeout=2)
        await group.start(fleet.run)
        swap = Colocation(fleet=fleet, client=client, trainer=NoRanks(), weight_sync=None, offload_train=False,
                          offload_rollout=True, recovers_engines=True)
        monitor = HealthMonitor(fleet=fleet, client=client, interval=0.2, timeout=1.0, failure_threshold=2,
                                pauses=[swap])
        await group.start(monitor.run)
        engine = fleet.engines[0]
        api = client.engine(engine.url)

        # released by someone else (not a swap the monitor knows of): alive, said so, never dead
        await api.release_memory_occupation(None)
        failures = monitor.stats.probe_failures  # (a first probe of a cold engine on a loaded box may time out)
        with anyio.fail_after(20):
            while monitor.stats.released < 3:  # noqa: ASYNC110 - polls the monitor's counters
                await anyio.sleep(0.05)
        assert monitor.stats.probe_failures == failures and monitor.stats.deaths == 0 and engine.alive
        await api.resume_memory_occupation(None)

        # released by the swap: probing stops from the release to the last resume
        with anyio.fail_after(20):
            while monitor.watches.get(engine.name) is None:  # noqa: ASYNC110 - polls the monitor's state
                await anyio.sleep(0.05)
        released_before = monitor.stats.released
        await swap.before_train(0, generate_s=0.0)
        paused_at = time.monotonic()
        await swap.during_train()  # what the engines hold while the ranks would train
        await anyio.sleep(1.0)
        await swap.after_train(0, "1", train_s=1.0)
        record = await swap.after_update()
        resumed_at = time.monotonic()
        starts = monitor.watches[engine.name].probe_starts
        assert not [t for t in starts if paused_at < t < resumed_at], "no probe starts during the swap"
        assert monitor.stats.released == released_before and monitor.stats.deaths == 0
        assert record["colocate/engine_weight_train_bytes"] == 0 and record["colocate/engine_weight_generate_bytes"] > 0
        assert record["colocate/engine_requests_refused_while_released"] == 0
        out = await api.generate({"text": "1 2=", "sampling_params": {"max_new_tokens": 2}})
        assert out["meta_info"]["finish_reason"]["type"] == "length"
        group.cancel_scope.cancel()
