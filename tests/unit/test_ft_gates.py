"""Every fault-tolerance gate, for each component choice, counted on the real classes the run wires.

Structural: `build_processes` / `build_fault_tolerance` / `build_weight_sync` (what `run_training` calls) over unstarted real
fleets and a real (unlaunched) TrainGroup: monitors, the armed injector, WeightSync's recovery gate, the eval
fleet's own probing. Behavioural: the same objects over running engines — recovery calls made by a weight
update with a dead engine, and probes made by an eval pin. The engines there are FAKE responders
(tests/support/fake_engine.py): the gates decide what happens around an engine, not what the engine computes, and
eight real CPU engines would cost a minute.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import anyio
import pytest

from coordinator.config import Config, ConfigWarning, parse_config
from coordinator.engines.client import EngineClient
from coordinator.engines.fleet import EngineFleet, EngineState
from coordinator.observe.progress import ProgressDisplay
from coordinator.plan import plan_for_launch
from coordinator.services import Processes, build_fault_tolerance, build_processes, build_weight_sync
from coordinator.train.group import TrainGroup
from coordinator.train.torchrun import TorchrunSpec
from tests.support.fake_engine import FakeEngine

CHOICES = {
    "rollout": ["--use-fault-tolerance", "--ft-components", "rollout"],
    "train": ["--use-fault-tolerance", "--ft-components", "train"],
    "both": ["--use-fault-tolerance", "--ft-components", "rollout,train"],
    "off": [],
}


def make_config(tmp_path: Path, *flags: str, engines: bool = True) -> Config:
    base = ["--hf-checkpoint", str(tmp_path), "--num-rollout", "2", "--rollout-batch-size", "1",
            "--prompt-data", "builtin:first_digit", "--inject-engine-fault-at-rollout", "1"]
    if engines:
        base += ["--rollout-num-engines", "2", "--eval-num-engines", "2", "--eval-interval", "1",
                 "--eval-prompt-data", "digits", "builtin:first_digit"]
    with warnings.catch_warnings():
        # --inject-engine-fault-at-rollout without rollout FT warns that it is ignored: that is the gate here
        warnings.simplefilter("ignore", ConfigWarning)
        return parse_config([*base, *flags])


def processes_for(config: Config, client: EngineClient, tmp_path: Path, rollout_urls: list[str] | None = None,
                  eval_urls: list[str] | None = None, exporter: Any = None) -> Processes:
    """What `build_processes` builds, over external (FAKE or absent) engines with short attach deadlines."""
    fleet = EngineFleet(client=client, external_urls=rollout_urls or ["127.0.0.1:1", "127.0.0.1:2"],
                        run_dir=tmp_path, probe_timeout=1, attach_timeout=5)
    eval_engines = None
    if config.eval_fleet_enabled:
        eval_engines = EngineFleet(client=client, group="eval", run_dir=tmp_path, probe_timeout=1,
                                   external_urls=eval_urls or ["127.0.0.1:3", "127.0.0.1:4"], attach_timeout=0.5)
    group = exporter or TrainGroup(TorchrunSpec(nproc_per_node=1), run_dir=tmp_path)
    weight_sync = build_weight_sync(config, None, tmp_path, fleet=fleet, client=client, router=None,
                                    trainer=group.commands)
    return Processes(client=client, fleet=fleet, eval_engines=eval_engines, train_group=group,
                     weight_sync=weight_sync)


@pytest.mark.parametrize("choice", list(CHOICES))
async def test_gates_per_component_choice(choice: str, tmp_path: Path) -> None:
    config = make_config(tmp_path, *CHOICES[choice])
    async with EngineClient(max_connections=4) as client:
        processes = processes_for(config, client, tmp_path)
        weight_sync = processes.weight_sync
        assert weight_sync is not None
        ft = build_fault_tolerance(config, processes, tokenizer=None, run_dir=tmp_path, metrics=None)
    rollout_ft = choice in ("rollout", "both")
    assert [m.group for m in ft.monitors] == (["rollout", "eval"] if rollout_ft else [])
    assert ft.injector is not None and ft.injector.armed is rollout_ft
    assert ft.injector.pending is rollout_ft  # always initialised, True only while armed and not yet fired
    assert weight_sync.recover_engines is rollout_ft
    assert ft.eval_fleet is not None and ft.eval_fleet.probe_before_pin is (not rollout_ft)
    if rollout_ft:
        # the rollout monitor pauses for weight updates, the eval monitor for pins
        assert weight_sync in ft.monitors[0].pauses and ft.eval_fleet in ft.monitors[1].pauses
        # one recovery per group: the monitor recovers rollout engines through the weight sync's own
        assert ft.monitors[0].recovery is weight_sync.recovery
        assert ft.monitors[1].recovery.weights is None, "eval engines never get training weights"


@pytest.mark.parametrize("mode", ["debug_train_only", "replay"])
async def test_no_monitor_no_injection_without_engines_even_with_rollout_ft(mode: str, tmp_path: Path) -> None:
    flags = [*CHOICES["both"]]
    if mode == "debug_train_only":
        config = make_config(tmp_path, *flags, "--debug-train-only", engines=False)
    else:
        config = make_config(tmp_path, *flags, "--load-debug-rollout-data", str(tmp_path / "{rollout_id}.rld"),
                             engines=False)
    assert config.rollout_ft_enabled and not config.health_monitor_enabled and not config.fault_injection_armed
    processes = build_processes(config, plan_for_launch(config), tmp_path, client=None, nodes=None,
                                progress=ProgressDisplay(enabled=False))
    ft = build_fault_tolerance(config, processes, tokenizer=None, run_dir=tmp_path, metrics=None)
    assert processes.fleet is None and processes.weight_sync is None and processes.train_group is not None
    assert ft.monitors == [] and ft.injector is None and ft.eval_fleet is None


class SnapshotExporter:
    """Stand-in for the TrainGroup and its commands' `export_weights`: the fake engines accept any snapshot
    directory."""

    def __init__(self) -> None:
        self.exports = 0

    @property
    def commands(self) -> SnapshotExporter:
        """What the services hand on from a TrainGroup (`TrainGroup.commands`): here, the stand-in itself."""
        return self

    async def export_weights(self, directory: Path, weight_version: str, keep: int = 2) -> Path:
        self.exports += 1
        path = Path(directory) / f"weights-{weight_version}"
        await anyio.Path(path).mkdir(parents=True, exist_ok=True)
        return path


@pytest.mark.parametrize("choice", list(CHOICES))
async def test_recovery_calls_and_eval_probes_per_component_choice(choice: str, tmp_path: Path) -> None:
    config = make_config(tmp_path, *CHOICES[choice])
    rollout_ft = choice in ("rollout", "both")
    fakes = [FakeEngine() for _ in range(4)]
    async with EngineClient(max_connections=16) as client, anyio.create_task_group() as group:
        for fake in fakes:
            await group.start(fake.run)
        exporter = SnapshotExporter()
        services = processes_for(config, client, tmp_path, rollout_urls=[f.url for f in fakes[:2]],
                                 eval_urls=[f.url for f in fakes[2:]], exporter=exporter)
        assert services.fleet is not None and services.eval_engines is not None
        await group.start(services.fleet.run)
        await group.start(services.eval_engines.run)
        weight_sync = services.weight_sync
        assert weight_sync is not None
        ft = build_fault_tolerance(config, services, tokenizer=None, run_dir=tmp_path, metrics=None)

        # A rollout engine found dead (as the dispatcher would), back by the time weights are pushed.
        victim = services.fleet.engines[0]
        services.fleet.mark_dead(victim, "request failed and the engine did not answer a probe")
        await weight_sync.update("1")
        assert weight_sync.recoveries == (1 if rollout_ft else 0)
        assert (victim.state is EngineState.ALIVE) is rollout_ft
        assert fakes[0].requests.get("/update_weights_from_disk", 0) == (1 if rollout_ft else 0)
        assert fakes[1].weight_version == "1"

        # The eval pin probes its engines itself exactly when no monitor watches them.
        assert ft.eval_fleet is not None
        before = sum(f.requests.get("/health_generate", 0) for f in fakes[2:])  # the fleet's attach probes
        pinned = await ft.eval_fleet.pin(str(tmp_path / "snap"), "7")
        assert sorted(pinned) == ["eval-ext-0", "eval-ext-1"]
        assert ft.eval_fleet.probes == (0 if rollout_ft else 2)
        assert sum(f.requests.get("/health_generate", 0) for f in fakes[2:]) - before == (0 if rollout_ft else 2)
        assert [f.weight_version for f in fakes[2:]] == ["7", "7"]
        assert fakes[0].weight_version != "7" and fakes[1].weight_version == "1", "eval pins stay on eval engines"
        group.cancel_scope.cancel()


@pytest.mark.parametrize("mode", ["in_place", "retract", "abort"])
async def test_the_pause_generation_mode_reaches_the_weight_sync(mode: str, tmp_path: Path) -> None:
    """miles' --pause-generation-mode is the mode WeightSync sends to /pause_generation (the engine's handling of
    each mode is tested in tests/integration/test_engine_contract.py)."""
    config = make_config(tmp_path, "--pause-generation-mode", mode)
    async with EngineClient(max_connections=4) as client:
        weight_sync = processes_for(config, client, tmp_path).weight_sync
    assert weight_sync is not None and weight_sync.pause_mode == mode
