"""Chaos: a full CPU run with rollout FT where the fault-injection switch kills one engine at rollout 2.

Every rollout still has the full batch, no sample is lost or duplicated, the killed engine is relaunched and
serves the current weight version (its samples in the rollout after the fault carry that version).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from coordinator.config import parse_config
from coordinator.engines.fleet import EngineState
from coordinator.run import run_training
from coordinator.services import Services
from replay.format import dump_path
from replay.reader import read_dump


class Watcher:
    def __init__(self, services: Services) -> None:
        self.services = services
        self.versions_after_step: dict[int, dict[str, str]] = {}

    async def after_step(self, rollout_id: int, weight_version: str) -> None:
        fleet = self.services.fleet
        self.versions_after_step[rollout_id] = {
            h.name: await self.services.client.engine(h.url).get_weight_version() for h in fleet.alive()
        }


async def test_engine_killed_at_rollout_2_is_relaunched_and_no_sample_is_lost(tiny_model_dir: Path,
                                                                               tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    template = str(tmp_path / "dumps" / "{rollout_id}.rld")
    config = parse_config([
        "--hf-checkpoint", str(tiny_model_dir), "--engine-backend", "cpu", "--rollout-num-engines", "2",
        "--actor-num-gpus-per-node", "1", "--prompt-data", "builtin:first_digit", "--num-rollout", "4",
        "--rollout-batch-size", "4", "--n-samples-per-prompt", "2", "--rollout-max-response-len", "4",
        "--sglang-server-concurrency", "8", "--run-dir", str(run_dir), "--no-progress", "--lr", "1e-3",
        "--use-fault-tolerance", "--ft-components", "rollout", "--inject-engine-fault-at-rollout", "2",
        "--rollout-health-check-interval", "0.5", "--rollout-health-check-timeout", "2",
        "--rollout-health-check-failure-threshold", "2", "--save-debug-rollout-data", template,
    ])
    assert config.fault_injection_armed
    watchers: list[Watcher] = []
    services_seen: list[Services] = []

    def hooks(services: Services) -> list[Any]:
        services_seen.append(services)
        watchers.append(Watcher(services))
        return watchers

    summary = await run_training(config, extra_hooks=hooks)
    services = services_seen[0]
    ft = summary["ft"]
    assert summary["rollouts"] == 4 and summary["train_steps"] == 4 and summary["final_weight_version"] == "4"
    assert ft["monitors"] == ["rollout"] and ft["injection_armed"] and ft["injected"] == ["rollout-0"]
    victim = services.fleet.engines[0]
    assert victim.incarnation == 2, "the killed engine was relaunched once"
    assert victim.state is EngineState.DEAD  # the fleet stopped it at the end of the run
    # both the monitor and the weight update's own recovery may ask; the fleet relaunches once (incarnation 2)
    assert ft["weight_sync_recoveries"] + ft["monitor_stats"]["rollout"]["recoveries"] >= 1

    for rollout_id in range(4):
        dumped = read_dump(dump_path(template, rollout_id))
        samples = dumped.samples
        assert len(samples) == 4 * 2, f"rollout {rollout_id} lost samples"
        keys = {(s.metadata["prompt_index"], s.sample_index) for s in samples}
        assert len(keys) == len(samples), f"rollout {rollout_id} has a duplicated sample"
        assert all(s.weight_versions == [str(rollout_id)] for s in samples), "every sample from the current policy"
    # after the recovery the relaunched engine serves the current version, and takes requests again
    assert watchers[0].versions_after_step[3] == {"rollout-0": "4", "rollout-1": "4"}
    later = [s for s in read_dump(dump_path(template, 3)).samples
             if s.metadata["engine"] == victim.url]
    assert later and all(s.weight_versions == [s.weight_versions[0]] for s in later)
