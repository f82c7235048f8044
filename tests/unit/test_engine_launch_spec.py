"""How one engine is launched, from the sglang and cluster slices and its placement (the engines package owns
it; the placement plan calls it once per engine)."""

from __future__ import annotations

import pytest

from coordinator.config import parse_config
from coordinator.engines.spec import engine_launch_spec

BASE = ["--hf-checkpoint", "/model", "--rollout-batch-size", "4", "--num-rollout", "1", "--prompt-data",
        "builtin:first_digit", "--rollout-seed", "7", "--sglang-server-concurrency", "16"]


def test_our_engine_on_the_cpu_gets_our_flags_and_never_the_sglang_passthrough() -> None:
    config = parse_config([*BASE, "--rollout-num-engines", "1", "--engine-backend", "auto",
                           "--sglang-context-length", "256", "--sglang-api-key", "k", "--sglang-mem-fraction-static",
                           "0.8"])
    spec = engine_launch_spec(model_path="/model", sglang=config.sglang, cluster=config.cluster,
                              seed=config.rollout.rollout_seed, enable_metrics=True, port=31234)
    assert spec.kind == "rayless" and spec.api_key == "k" and spec.env == () and spec.port == 31234
    assert spec.extra_args == ("--weight-version", "0", "--context-length", "256", "--enable-metrics",
                               "--random-seed", "7", "--max-running-requests", "16", "--device", "cpu")
    assert spec.command(1234)[2] == "workers.engine"


def test_our_engine_on_cuda_sees_only_its_gpu() -> None:
    config = parse_config([*BASE, "--rollout-num-gpus", "2"])
    spec = engine_launch_spec(model_path="/model", sglang=config.sglang, cluster=config.cluster, seed=7,
                              enable_metrics=False, backend="rayless", device="cuda", gpus=(5,), visible_devices="5")
    assert spec.env == (("CUDA_VISIBLE_DEVICES", "5"),)
    assert spec.extra_args[-4:] == ("--device", "cuda", "--base-gpu-id", "0")
    with pytest.raises(ValueError, match="exactly one GPU"):
        engine_launch_spec(model_path="/model", sglang=config.sglang, cluster=config.cluster, seed=7,
                           enable_metrics=False, backend="rayless", device="cuda", gpus=(4, 5), visible_devices="4,5")


def test_sglang_gets_its_first_gpu_its_tensor_parallel_size_and_the_passthrough() -> None:
    config = parse_config([*BASE, "--rollout-num-gpus", "4", "--rollout-num-gpus-per-engine", "2",
                           "--sglang-mem-fraction-static", "0.8"])
    spec = engine_launch_spec(model_path="/model", sglang=config.sglang, cluster=config.cluster, seed=7,
                              enable_metrics=False, backend="sglang", device="cuda", gpus=(6, 7),
                              visible_devices="6,7")
    assert spec.kind == "sglang" and spec.env == ()  # it inherits the coordinator's CUDA_VISIBLE_DEVICES
    assert spec.extra_args == ("--weight-version", "0", "--tp-size", "2", "--base-gpu-id", "6",
                               "--mem-fraction-static", "0.8")
    assert spec.command(1)[2] == "sglang.launch_server"
