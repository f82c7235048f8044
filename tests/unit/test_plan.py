"""The placement plan for 0, 1, 2 and 8 GPUs (the count injected), the engine backend choice, the
over-subscribed plan's error, and the GPU inventory read from the environment."""

from __future__ import annotations

import pytest

from coordinator.config import ConfigError, parse_config
from coordinator.plan import GpuInventory, build_plan, describe_plan, detect_gpus, plan_for_launch
from coordinator.plan.gpus import cuda_visible_ids

BASE = ["--hf-checkpoint", "/m", "--rollout-batch-size", "8", "--num-rollout", "2", "--prompt-data",
        "builtin:first_digit", "--run-dir", "/runs/x"]


def plan(*flags: str, gpus: int | GpuInventory, sglang: bool = True, lenient: bool = False):
    inventory = gpus if isinstance(gpus, GpuInventory) else GpuInventory.of_count(gpus, "injected", injected=True)
    return build_plan(parse_config([*BASE, *flags]), inventory, has_sglang=sglang, lenient=lenient)


def env(slot) -> dict[str, str]:
    return dict(slot.spec.env)


def assert_disjoint(node) -> None:
    used = [gpu for slot in node.processes() for gpu in slot.gpus]
    assert len(used) == len(set(used)), used


# -- 0 GPUs ------------------------------------------------------------------------------------------------
def test_no_gpu_plans_cpu_engines_and_gloo_ranks_as_before() -> None:
    p = plan("--rollout-num-engines", "2", "--actor-num-gpus-per-node", "2", gpus=0)
    node = p.local
    assert node.ranks is not None and node.ranks.device == "cpu" and node.ranks.env == ()
    assert [s.name for s in node.rollout_engines] == ["rollout-0", "rollout-1"]
    for slot in node.rollout_engines:
        assert slot.choice.backend == "rayless" and slot.gpus == () and env(slot) == {}
        assert slot.command()[2] == "workers.engine" and slot.command()[-2:] == ["--device", "cpu"]
    ports = [s.port for s in node.rollout_engines] + [node.ranks.control_port]
    assert len(set(ports)) == 3 and node.gpus_needed == 0


def test_gpu_engines_on_a_node_without_gpus_stop_at_start_up_naming_the_flags() -> None:
    with pytest.raises(ConfigError) as caught:
        plan("--rollout-num-gpus", "1", "--debug-rollout-only", gpus=0)
    message = str(caught.value)
    assert "needs 1 GPUs on this node but it shows none" in message
    assert "--rollout-num-gpus 1 (1 rollout engine)" in message and "--rollout-num-engines" in message


def test_engine_backend_cpu_keeps_gpu_sized_fleets_on_the_cpu() -> None:
    p = plan("--rollout-num-gpus", "2", "--engine-backend", "cpu", "--debug-rollout-only", gpus=0)
    assert [s.choice.device for s in p.local.rollout_engines] == ["cpu", "cpu"]


# -- 1 GPU -------------------------------------------------------------------------------------------------
def test_one_gpu_takes_the_rank_while_cpu_engines_stay_on_the_cpu() -> None:
    node = plan("--rollout-num-engines", "1", gpus=1).local
    assert node.ranks.gpus == (0,) and node.ranks.env == (("CUDA_VISIBLE_DEVICES", "0"),)
    assert node.ranks.environment()["RAYLESS_CONTROL_TOKEN"] == "***"
    assert node.rollout_engines[0].gpus == () and node.rollout_engines[0].choice.device == "cpu"


def test_one_gpu_cannot_hold_a_rank_and_an_engine_apart() -> None:
    with pytest.raises(ConfigError, match=r"needs 2 GPUs on this node but it shows 1 \(injected\): "
                                          r"--actor-num-gpus-per-node 1 \(1 training rank\) \+ --rollout-num-gpus 1 "
                                          r"\(1 rollout engine\) = 2"):
        plan("--rollout-num-gpus", "1", gpus=1)


def test_without_sglang_auto_runs_our_engine_on_cuda() -> None:
    node = plan("--rollout-num-gpus", "1", "--debug-rollout-only", gpus=1, sglang=False).local
    (engine,) = node.rollout_engines
    assert node.ranks is None
    assert engine.choice.backend == "rayless" and engine.choice.device == "cuda" and "not importable" in engine.choice.reason
    assert env(engine) == {"CUDA_VISIBLE_DEVICES": "0"}
    assert engine.command()[-4:] == ["--device", "cuda", "--base-gpu-id", "0"]


# -- 2 GPUs ------------------------------------------------------------------------------------------------
def test_two_gpus_rank_first_then_our_engine_on_the_second() -> None:
    node = plan("--rollout-num-gpus", "1", gpus=2, sglang=False).local
    assert node.ranks.gpus == (0,) and node.rollout_engines[0].gpus == (1,)
    assert env(node.rollout_engines[0]) == {"CUDA_VISIBLE_DEVICES": "1"}
    assert_disjoint(node)


def test_children_get_the_coordinators_gpu_ids_not_positions() -> None:
    inventory = GpuInventory(ids=("6", "7"), source="CUDA_VISIBLE_DEVICES='6,7'")
    node = plan("--rollout-num-gpus", "1", gpus=inventory, sglang=False).local
    assert node.ranks.env == (("CUDA_VISIBLE_DEVICES", "6"),)
    assert env(node.rollout_engines[0]) == {"CUDA_VISIBLE_DEVICES": "7"}
    assert "(CUDA ids 7)" in describe_plan(build_plan(parse_config([*BASE, "--rollout-num-gpus", "1"]), inventory,
                                                      has_sglang=False))


# -- 8 GPUs ------------------------------------------------------------------------------------------------
def test_eight_gpus_four_engines_of_tp1_and_four_ranks() -> None:
    p = plan("--rollout-num-gpus", "4", "--rollout-num-gpus-per-engine", "1", "--actor-num-gpus-per-node", "4",
             gpus=8)
    node = p.local
    assert node.ranks.gpus == (0, 1, 2, 3) and node.ranks.env == (("CUDA_VISIBLE_DEVICES", "0,1,2,3"),)
    assert node.ranks.spec.nproc_per_node == 4
    for index, slot in enumerate(node.rollout_engines):
        assert slot.choice.backend == "sglang" and slot.gpus == (4 + index,)
        command = slot.command()
        assert command[2] == "sglang.launch_server"
        assert command[command.index("--base-gpu-id") + 1] == str(4 + index)
        assert command[command.index("--tp-size") + 1] == "1"
        assert command[command.index("--port") + 1] == str(slot.port)
    assert_disjoint(node)
    assert node.gpus_needed == 8


def test_eight_gpus_two_engines_of_tp2_and_four_ranks() -> None:
    node = plan("--rollout-num-gpus", "4", "--rollout-num-gpus-per-engine", "2", "--actor-num-gpus-per-node", "4",
                gpus=8).local
    assert [slot.gpus for slot in node.rollout_engines] == [(4, 5), (6, 7)]
    for slot, base in zip(node.rollout_engines, ("4", "6"), strict=True):
        command = slot.command()
        assert command[command.index("--base-gpu-id") + 1] == base
        assert command[command.index("--tp-size") + 1] == "2"
    assert_disjoint(node)


def test_eval_engines_come_after_the_rollout_engines() -> None:
    node = plan("--rollout-num-gpus", "2", "--actor-num-gpus-per-node", "2", "--eval-num-gpus", "2",
                "--eval-interval", "1", "--eval-prompt-data", "d", "builtin:first_digit", gpus=8).local
    assert [s.gpus for s in node.rollout_engines] == [(2,), (3,)]
    assert [(s.name, s.gpus) for s in node.eval_engines] == [("eval-0", (4,)), ("eval-1", (5,))]
    assert node.gpus_needed == 6


def test_eval_engines_have_their_own_tp_size_and_sglang_overrides() -> None:
    """miles: the fleet's TP size is --eval-num-gpus-per-engine (not the rollout's), and each --eval-sglang-*
    replaces the inherited --sglang-* of the same name for the eval engines only."""
    node = plan("--rollout-num-gpus", "2", "--rollout-num-gpus-per-engine", "2", "--actor-num-gpus-per-node", "2",
                "--eval-num-gpus", "4", "--eval-num-gpus-per-engine", "2", "--eval-interval", "1",
                "--eval-prompt-data", "d", "builtin:first_digit", "--sglang-mem-fraction-static", "0.7",
                "--sglang-enable-metrics", "--sglang-chunked-prefill-size", "4096",
                "--eval-sglang-mem-fraction-static", "0.9", "--no-eval-sglang-enable-metrics", gpus=8).local
    assert [s.gpus for s in node.rollout_engines] == [(2, 3)]
    assert [s.gpus for s in node.eval_engines] == [(4, 5), (6, 7)]
    rollout, evals = node.rollout_engines[0].command(), node.eval_engines[0].command()
    assert rollout[rollout.index("--mem-fraction-static") + 1] == "0.7" and "--enable-metrics" in rollout
    assert evals[evals.index("--tp-size") + 1] == "2"
    assert evals[evals.index("--mem-fraction-static") + 1] == "0.9" and evals.count("--mem-fraction-static") == 1
    assert evals[evals.index("--chunked-prefill-size") + 1] == "4096"
    assert "--enable-metrics" not in evals


def test_the_over_subscribed_plan_names_every_flag_and_the_numbers() -> None:
    flags = ["--rollout-num-gpus", "4", "--rollout-num-gpus-per-engine", "2", "--actor-num-gpus-per-node", "4",
             "--eval-num-gpus", "2", "--eval-num-gpus-per-engine", "2", "--eval-interval", "1",
             "--eval-prompt-data", "d", "builtin:first_digit"]
    with pytest.raises(ConfigError) as caught:
        plan(*flags, gpus=8)
    assert str(caught.value) == (
        "the placement plan needs 10 GPUs on this node but it shows 8 (injected): --actor-num-gpus-per-node 4 "
        "(4 training ranks) + --rollout-num-gpus 4 (2 rollout engines × --rollout-num-gpus-per-engine 2) + "
        "--eval-num-gpus 2 (1 eval engine × --eval-num-gpus-per-engine 2) = 10; lower one of them, or make more "
        "GPUs visible (CUDA_VISIBLE_DEVICES)")
    lenient = plan(*flags, gpus=8, lenient=True)
    assert lenient.warnings and "needs 10 GPUs" in lenient.warnings[0]
    assert lenient.local.gpus.count == 10 and lenient.local.eval_engines[0].gpus == (8, 9)


# -- the backend choice ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--rollout-num-engines", "1", "--engine-backend", "sglang"], "--engine-backend sglang runs on GPUs"),
        (["--rollout-num-gpus", "4", "--rollout-num-gpus-per-engine", "2", "--engine-backend", "rayless"],
         "our engine runs on one GPU, but --rollout-num-gpus-per-engine is 2"),
    ],
)
def test_a_backend_that_cannot_run_the_fleet_is_refused(flags: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        plan(*flags, "--debug-rollout-only", gpus=8)


def test_sglang_missing_fails_a_launch_and_warns_a_dry_run() -> None:
    flags = ["--rollout-num-gpus", "4", "--rollout-num-gpus-per-engine", "2", "--debug-rollout-only"]
    with pytest.raises(ConfigError, match="tensor parallelism needs SGLang, but the sglang package is not importable"):
        plan(*flags, gpus=4, sglang=False)
    dry = plan(*flags, gpus=4, sglang=False, lenient=True)
    assert dry.local.rollout_engines[0].choice.backend == "sglang" and "not importable" in dry.warnings[0]
    assert "sglang is installed" in plan(*flags, gpus=4).rollout_choice.reason


# -- what the printout shows --------------------------------------------------------------------------------
def test_the_printout_shows_every_process_and_no_secret() -> None:
    p = plan("--rollout-num-gpus", "2", "--actor-num-gpus-per-node", "2", "--use-sglang-router",
             "--sglang-api-key", "hunter2-secret", "--update-weight-transfer-mode", "distributed",
             "--update-weight-buffer-size", "16777216", gpus=4)
    text = describe_plan(p)
    assert "hunter2-secret" not in text and "RAYLESS_CONTROL_TOKEN=***" in text
    assert "--config '<0600 file: api-key>'" in text and "--api-key" not in text  # the key goes in a file
    for slot in p.local.processes():
        assert slot.name in text
    assert p.local.router is not None and f"http 127.0.0.1:{p.local.router.port}" in text
    assert "weight sync: distributed" in text and "bucket size 16 MiB (--update-weight-buffer-size 16777216)" in text


# -- the GPUs the node shows -------------------------------------------------------------------------------
def test_the_injected_count_is_for_planning_only(monkeypatch: pytest.MonkeyPatch) -> None:
    assert detect_gpus({"RAYLESS_PLAN_GPU_COUNT": "8"}).count == 8
    with pytest.raises(ConfigError, match="RAYLESS_PLAN_GPU_COUNT='eight'"):
        detect_gpus({"RAYLESS_PLAN_GPU_COUNT": "eight"})
    monkeypatch.setenv("RAYLESS_PLAN_GPU_COUNT", "8")
    with pytest.raises(ConfigError, match="for planning tests and --dry-run only; unset it to launch"):
        plan_for_launch(parse_config([*BASE, "--rollout-num-engines", "1"]))


def test_cuda_visible_devices_is_read_as_cuda_reads_it() -> None:
    physical = ["GPU-aaaa", "GPU-bbbb", "GPU-cccc", "GPU-dddd"]
    assert cuda_visible_ids("2,0", physical) == ("2", "0")
    assert cuda_visible_ids("1,7,2", physical) == ("1",)  # GPU 7 does not exist: CUDA ignores it and what follows
    assert cuda_visible_ids("GPU-bbbb,3", physical) == ("GPU-bbbb", "3")
    assert cuda_visible_ids("", physical) == () and cuda_visible_ids("-1", physical) == ()
    assert cuda_visible_ids("4,5", None) == ("4", "5")  # no driver tool to check against: taken as given


def test_multi_node_plan_needs_this_nodes_rank_node_0s_address_and_a_token(monkeypatch: pytest.MonkeyPatch) -> None:
    for variable in ("SLURM_NODEID", "SLURM_NNODES", "SLURM_JOB_NODELIST", "SLURM_STEP_NODELIST", "SLURM_NODELIST",
                     "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "RAYLESS_CONTROL_TOKEN"):
        monkeypatch.delenv(variable, raising=False)
    flags = ("--rollout-num-engines", "1", "--actor-num-nodes", "2")
    with pytest.raises(ConfigError, match="this node's rank is unknown: run the command under srun"):
        plan(*flags, gpus=0)
    with pytest.raises(ConfigError, match=r"node 0's address is unknown: .* or give --rdzv-endpoint HOST:PORT"):
        plan(*flags, "--actor-node-rank", "1", gpus=0)
    with pytest.raises(ConfigError, match="every node needs the control token: set RAYLESS_CONTROL_TOKEN"):
        plan(*flags, "--actor-node-rank", "1", "--rdzv-endpoint", "10.0.0.1:29400", gpus=0)
    monkeypatch.setenv("RAYLESS_CONTROL_TOKEN", "t" * 32)
    p = plan(*flags, "--actor-node-rank", "1", "--rdzv-endpoint", "10.0.0.1:29400", gpus=0)
    node = p.local
    assert node.node_rank == 1 and node.ranks.spec.node_rank == 1 and node.rollout_engines == ()
    assert "--node-rank 1" in " ".join(node.ranks.command())
    assert p.remote_engines == (("rollout-0", "rollout", 0),)  # one engine: node 0's


# -- slime's delta weight updates ------------------------------------------------------------------------------
def test_delta_weight_updates_run_on_our_engines_and_full_updates_elsewhere() -> None:
    delta = ("--update-weight-mode", "delta", "--update-weight-transport", "disk", "--update-weight-delta-encoding",
             "overwrite", "--update-weight-local-checkpoint-dir", "/nvme/ckpt")
    p = plan(*delta, "--rollout-num-engines", "1", gpus=0)
    assert p.local.rollout_engines[0].choice.backend == "rayless"
    assert p.weight_sync.update_mode == "delta" and "changed since the engines' version" in p.weight_sync.detail
    config = parse_config([*BASE, *delta, "--rollout-num-engines", "1"])
    assert (config.sglang.update_weight_mode, config.sglang.update_weight_delta_encoding) == ("delta", "overwrite")
    on_sglang = plan(*delta, "--rollout-num-gpus", "1", gpus=2)  # SGLang has no /pull_weights
    assert on_sglang.weight_sync.update_mode == "full"
    assert any("the SGLang engines take full weight updates" in w for w in on_sglang.warnings), on_sglang.warnings
    attached = plan(*delta, "--rollout-external-engine-addrs", "127.0.0.1:30000", gpus=0)
    assert attached.weight_sync.update_mode == "full"
    assert any("--rollout-external-engine-addrs take full" in w for w in attached.warnings)
    assert plan("--rollout-num-engines", "1", gpus=0).weight_sync.update_mode == "full"  # slime's default
    with pytest.raises(ConfigError, match="not supported with --colocate"):
        plan(*delta, "--colocate", "--actor-num-gpus-per-node", "1", gpus=1)


@pytest.mark.parametrize(("flags", "message"), [
    (("--update-weight-mode", "delta", "--update-weight-transfer-mode", "distributed"),
     "--update-weight-mode=delta requires --update-weight-transport=disk"),
    (("--update-weight-transport", "nccl"), "is rayless' --update-weight-transfer-mode distributed"),
    (("--update-weight-transport", "disk", "--update-weight-transfer-mode", "broadcast"), "choose one carrier"),
    (("--update-weight-delta-checksum", "blake3"), "xxh3-128 only \\(blake3 is not a dependency"),
])
def test_slimes_weight_update_flags_that_rayless_cannot_honour_are_refused_by_name(flags, message) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_config([*BASE, *flags])
