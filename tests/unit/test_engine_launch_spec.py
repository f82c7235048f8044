"""How the run's engines are launched, from the sglang and cluster slices (the engines package owns it)."""

from __future__ import annotations

from coordinator.config import parse_config
from coordinator.engines.launch import engine_launch_spec

BASE = ["--hf-checkpoint", "/model", "--rollout-batch-size", "4", "--num-rollout", "1", "--prompt-data",
        "builtin:first_digit", "--rollout-seed", "7", "--sglang-server-concurrency", "16"]


def test_the_cpu_engine_gets_our_flags_and_never_the_sglang_passthrough() -> None:
    config = parse_config([*BASE, "--rollout-num-engines", "1", "--engine-backend", "auto",
                           "--sglang-context-length", "256", "--sglang-api-key", "k", "--sglang-mem-fraction-static",
                           "0.8"])
    spec = engine_launch_spec(model_path="/model", sglang=config.sglang, cluster=config.cluster,
                              seed=config.rollout.rollout_seed, enable_metrics=True, cuda_available=False)
    assert spec.kind == "cpu" and spec.api_key == "k"
    assert spec.extra_args == ("--weight-version", "0", "--context-length", "256", "--enable-metrics",
                               "--random-seed", "7", "--max-running-requests", "16")
    assert spec.command(1234)[2] == "workers.engine"


def test_sglang_gets_its_tensor_parallel_size_and_the_passthrough() -> None:
    config = parse_config([*BASE, "--rollout-num-gpus", "4", "--rollout-num-gpus-per-engine", "2",
                           "--sglang-mem-fraction-static", "0.8"])
    spec = engine_launch_spec(model_path="/model", sglang=config.sglang, cluster=config.cluster, seed=7,
                              enable_metrics=False, cuda_available=True)
    assert spec.kind == "sglang"
    assert spec.extra_args == ("--weight-version", "0", "--tp-size", "2", "--mem-fraction-static", "0.8")
    forced = parse_config([*BASE, "--rollout-num-engines", "1", "--engine-backend", "cpu"])
    assert engine_launch_spec(model_path="/m", sglang=forced.sglang, cluster=forced.cluster, seed=1,
                              enable_metrics=False, cuda_available=True).kind == "cpu"
