"""Colocation in the placement plan and the config (issue 12 item 1, 4): the engines on the ranks' GPUs, the
sizing slime and miles give `--colocate`, the memory flags each engine gets, where snapshots go, the refusals."""

from __future__ import annotations

import json
import struct
import warnings
from pathlib import Path

import pytest

from coordinator.config import ConfigError, ConfigWarning, parse_config
from coordinator.plan import GpuInventory, build_plan, describe_plan, snapshot_place
from coordinator.plan.snapshots import remove_tmpfs_snapshots, snapshot_bytes

BASE = ["--hf-checkpoint", "/m", "--rollout-batch-size", "8", "--num-rollout", "2", "--prompt-data",
        "builtin:first_digit", "--run-dir", "/runs/x"]


def plan(*flags: str, gpus: int, sglang: bool = True, lenient: bool = False):
    inventory = GpuInventory.of_count(gpus, "injected", injected=True)
    return build_plan(parse_config([*BASE, *flags]), inventory, has_sglang=sglang, lenient=lenient)


def test_colocate_puts_each_engine_on_the_ranks_gpus_tp1() -> None:
    p = plan("--colocate", "--actor-num-gpus-per-node", "8", gpus=8)
    node = p.local
    assert p.policy == "colocate" and node.gpus_needed == 8
    assert node.ranks.gpus == tuple(range(8))
    assert [s.gpus for s in node.rollout_engines] == [(i,) for i in range(8)]
    assert [s.command()[s.command().index("--base-gpu-id") + 1] for s in node.rollout_engines] == \
        [str(i) for i in range(8)]
    for slot in node.rollout_engines:
        assert "--enable-memory-saver" in slot.command()  # SGLang releases memory only with it


def test_colocate_with_an_eval_fleet_is_refused_as_miles_does() -> None:
    """miles: "Snapshot eval is not supported with --colocate" (the fleet's snapshots and pins would compete
    with the engines that release their memory every step)."""
    with pytest.raises(ConfigError, match="snapshot eval is not supported with --colocate"):
        plan("--colocate", "--actor-num-gpus-per-node", "4", "--rollout-num-gpus-per-engine", "2",
             "--eval-num-gpus", "2", "--eval-interval", "1", "--eval-prompt-data", "d", "builtin:first_digit",
             gpus=8)


def test_colocate_sizes_the_fleet_from_the_training_gpus_and_says_when_it_overrides() -> None:
    config = parse_config([*BASE, "--colocate", "--actor-num-gpus-per-node", "4"])
    assert config.cluster.rollout_num_gpus == 4 and config.num_launched_rollout_engines == 4
    with pytest.warns(ConfigWarning, match="--rollout-num-gpus 2 is replaced by 4"):
        config = parse_config([*BASE, "--colocate", "--actor-num-gpus-per-node", "4", "--rollout-num-gpus", "2"])
    assert config.cluster.rollout_num_gpus == 4
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same number is no override: nothing to say
        parse_config([*BASE, "--colocate", "--actor-num-gpus-per-node", "4", "--rollout-num-gpus", "4"])


def test_colocate_implies_both_offloads_and_each_can_be_turned_off() -> None:
    config = parse_config([*BASE, "--colocate", "--rollout-num-engines", "1"])
    assert config.colocated and config.offloads_train and config.offloads_rollout
    config = parse_config([*BASE, "--colocate", "--rollout-num-engines", "1", "--no-offload-train"])
    assert not config.offloads_train and config.offloads_rollout
    config = parse_config([*BASE, "--rollout-num-engines", "1", "--offload-train"])
    assert not config.colocated and config.offloads_train and not config.offloads_rollout
    assert not parse_config([*BASE, "--rollout-num-engines", "1"]).swaps_memory


def test_colocation_on_the_cpu_is_cpu_engines_and_gloo_ranks_with_a_disk_spill() -> None:
    p = plan("--colocate", "--rollout-num-engines", "2", "--actor-num-gpus-per-node", "2", gpus=0)
    assert p.policy == "colocate" and p.local.ranks.device == "cpu"
    for slot in p.local.rollout_engines:
        command = slot.command()
        assert slot.choice.device == "cpu"
        assert command[command.index("--weight-spill-dir") + 1] == f"/runs/x/engine-spill/{slot.name}"
    assert p.swap is not None and p.swap.offload_train and p.swap.offload_rollout
    text = describe_plan(p)
    assert "engines release memory (weights, kv_cache, cuda_graph) → ranks bring parameters" in text


def test_colocated_engines_over_the_node_name_both_flags_as_sharing() -> None:
    with pytest.raises(ConfigError) as caught:
        plan("--colocate", "--actor-num-gpus-per-node", "8", gpus=4)
    message = str(caught.value)
    assert "needs 8 GPUs on this node but it shows 4" in message
    assert ("--actor-num-gpus-per-node 8 (8 training ranks) and --rollout-num-gpus 8 (8 rollout engines) sharing "
            "GPUs under --colocate (8) = 8") in message


def test_num_gpus_per_node_caps_the_gpus_a_node_is_planned_with() -> None:
    p = plan("--colocate", "--actor-num-gpus-per-node", "4", "--num-gpus-per-node", "4", gpus=8)
    assert p.local.gpus.count == 4 and "the first 4 by --num-gpus-per-node" in p.local.gpus.source
    with pytest.raises(ConfigError, match="--num-gpus-per-node"):
        plan("--actor-num-gpus-per-node", "4", "--rollout-num-gpus", "4", "--num-gpus-per-node", "4", gpus=8)


def test_a_distributed_update_between_a_rank_and_an_engine_on_one_gpu_is_refused() -> None:
    flags = ["--colocate", "--actor-num-gpus-per-node", "2", "--update-weight-transfer-mode", "broadcast"]
    with pytest.raises(ConfigError, match="cannot form an NCCL group"):
        plan(*flags, gpus=2)
    assert any("cannot form an NCCL group" in w for w in plan(*flags, gpus=2, lenient=True).warnings)
    # colocated on the CPU, ranks and engines meet over gloo
    assert plan("--colocate", "--rollout-num-engines", "1", "--update-weight-transfer-mode", "distributed",
                gpus=0).weight_sync.mode == "distributed"


def test_colocate_refuses_attached_engines_and_async_rollout() -> None:
    with pytest.raises(ConfigError, match="--rollout-external-engine-addrs attaches engines running elsewhere"):
        parse_config([*BASE, "--colocate", "--rollout-external-engine-addrs", "10.0.0.1:30000"])
    with pytest.raises(ConfigError, match="--colocate and --async-rollout"):
        parse_config([*BASE, "--colocate", "--rollout-num-engines", "1", "--async-rollout"])


def write_checkpoint(directory: Path, parameters: int) -> Path:
    """A safetensors file whose header names `parameters` bfloat16 values (the data is never read)."""
    directory.mkdir(parents=True, exist_ok=True)
    header = json.dumps({"w": {"dtype": "BF16", "shape": [parameters], "data_offsets": [0, 2 * parameters]},
                         "__metadata__": {"format": "pt"}}).encode()
    (directory / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)
    return directory


def test_snapshots_go_to_tmpfs_when_it_holds_them_and_to_the_run_dir_otherwise(tmp_path: Path) -> None:
    model = write_checkpoint(tmp_path / "model", 1000)
    assert snapshot_bytes(str(model)) == 4000  # float32 snapshots of 1000 parameters
    shm = tmp_path / "shm"
    shm.mkdir()
    place = snapshot_place(run_dir=tmp_path / "run", model_path=str(model), keep=2, colocated=True, tmpfs=shm)
    assert place.tmpfs and place.directory.parent.parent == shm and "3 snapshots" in place.why
    place.directory.mkdir(parents=True)
    remove_tmpfs_snapshots(place)
    assert list(shm.iterdir()) == []  # the run's private directory is gone, nothing else was there
    huge = write_checkpoint(tmp_path / "huge", 10**15)
    place = snapshot_place(run_dir=tmp_path / "run", model_path=str(huge), keep=2, colocated=True, tmpfs=shm)
    assert not place.tmpfs and place.directory == tmp_path / "run" / "weights" and "free, less than" in place.why
    place = snapshot_place(run_dir=tmp_path / "run", model_path=str(model), keep=2, colocated=True,
                           tmpfs=tmp_path / "absent")
    assert not place.tmpfs and "absent or not writable" in place.why
    place = snapshot_place(run_dir=tmp_path / "run", model_path=str(model), keep=2, colocated=False, tmpfs=shm)
    assert place == snapshot_place(run_dir=tmp_path / "run", model_path=None, keep=2, colocated=False)
    assert not place.tmpfs
    # several nodes: node k's engines cannot read node 0's /dev/shm, so the shared run directory is used
    place = snapshot_place(run_dir=tmp_path / "run", model_path=str(model), keep=2, colocated=True, tmpfs=shm,
                           nodes=2)
    assert not place.tmpfs and place.directory == tmp_path / "run" / "weights" and "2 nodes" in place.why
