"""How one engine is launched, from the sglang and cluster slices and its placement (the engines package owns
it; the placement plan calls it once per engine)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from coordinator.config import parse_config
from coordinator.engines.secrets_file import secrets_file
from coordinator.engines.spec import engine_launch_spec
from workers.engine.args import parse_args

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


def test_no_secret_is_on_the_command_line_they_are_in_a_0600_file_the_engine_reads(tmp_path: Path) -> None:
    config = parse_config([*BASE, "--rollout-num-gpus", "1", "--sglang-api-key", "k-SENTINEL", "--sglang-admin-api-key",
                           "adm-SENTINEL", "--sglang-mem-fraction-static", "0.8"])
    sglang = engine_launch_spec(model_path="/model", sglang=config.sglang, cluster=config.cluster, seed=7,
                                enable_metrics=False, backend="sglang", device="cuda", gpus=(0,), visible_devices="0")
    assert sglang.secrets() == {"api-key": "k-SENTINEL", "admin-api-key": "adm-SENTINEL"}
    shown = sglang.command(1)
    assert "SENTINEL" not in " ".join(shown) and "--api-key" not in shown and "--admin-api-key" not in shown
    assert shown[shown.index("--config") + 1] == "<0600 file: api-key, admin-api-key>"
    assert "--mem-fraction-static" in shown  # the rest of the passthrough is still there

    ours = engine_launch_spec(model_path=str(tmp_path), sglang=config.sglang, cluster=config.cluster, seed=7,
                              enable_metrics=False)
    with secrets_file(ours.secrets()) as path:
        assert path is not None
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700
        command = ours.command(1234, secrets_file=path)
        assert "k-SENTINEL" not in " ".join(command) and command[command.index("--config") + 1] == path
        (tmp_path / "config.json").write_text("{}")
        assert parse_args(command[3:]).api_key == "k-SENTINEL"  # what our engine reads from it
    assert not os.path.exists(os.path.dirname(path)), "the file is gone once the launch is done"
    with secrets_file({}) as nothing:
        assert nothing is None
