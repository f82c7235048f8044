"""`--deterministic-mode` / `--true-on-policy-mode` at start-up: parsed, implied, refused where they cannot hold
(ConfigError, which the CLI turns into exit 2 before anything launches), and what the plan gives each process."""

from __future__ import annotations

import subprocess
import sys
import warnings

import pytest

from coordinator.config import ConfigError, parse_config
from coordinator.config.determinism_rules import check_engine_backends
from coordinator.config.fields import ConfigWarning
from coordinator.plan import GpuInventory, build_plan
from coordinator.train.settings import train_settings

BASE = ["--hf-checkpoint", "/m", "--rollout-batch-size", "8", "--num-rollout", "2", "--prompt-data",
        "builtin:first_digit", "--run-dir", "/runs/x"]


def config(*flags: str):
    return parse_config([*BASE, *flags])


def plan(*flags: str, gpus: int = 0, sglang: bool = False):
    return build_plan(config(*flags), GpuInventory.of_count(gpus, "injected", injected=True), has_sglang=sglang)


def test_the_flags_parse_and_true_on_policy_implies_deterministic_settings() -> None:
    off = config("--rollout-num-engines", "1")
    assert not off.determinism.active and train_settings(off).determinism.threads is None
    on = config("--rollout-num-engines", "1", "--true-on-policy-mode")
    assert on.determinism.true_on_policy_mode and on.determinism.active
    settings = train_settings(on)
    assert settings.determinism.threads == 1 and settings.batching.micro_batch_size == 1


@pytest.mark.parametrize(("flags", "named"), [
    (["--async-rollout"], "--async-rollout"),
    (["--partial-rollout"], "--partial-rollout"),
    (["--rollout-external-engine-addrs", "127.0.0.1:30000"], "--rollout-external-engine-addrs"),
    (["--sglang-router-ip", "127.0.0.1", "--sglang-router-port", "30000"], "--sglang-router-ip"),
])
def test_what_makes_two_runs_differ_is_refused_naming_the_flag(flags: list[str], named: str) -> None:
    with pytest.raises(ConfigError) as caught:
        config("--rollout-num-engines", "1", "--deterministic-mode", *flags)
    assert "--deterministic-mode" in str(caught.value) and named in str(caught.value)


@pytest.mark.parametrize("mode", ["--deterministic-mode", "--true-on-policy-mode"])
def test_over_sampling_is_taken_with_a_warning_that_says_what_still_holds(mode: str) -> None:
    """miles' own scripts pair the mode with dynamic sampling (examples/lora/run-qwen3-4B-megatron-lora.sh): the
    per-sample promise holds, only which groups are kept depends on timing; equal sizes say nothing."""
    with pytest.warns(ConfigWarning) as caught:
        taken = config("--rollout-num-engines", "1", mode, "--over-sampling-batch-size", "16")
    assert taken.determinism.active and taken.rollout.over_sampling_batch_size == 16
    (message,) = [str(warning.message) for warning in caught if "over-sampling" in str(warning.message)]
    assert message.startswith(f"{mode} with --over-sampling-batch-size 16 > --rollout-batch-size 8: which groups "
                              "are kept is set by which finish first"), message
    assert "each sample is still generated and scored deterministically" in message
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConfigWarning)
        assert config("--rollout-num-engines", "1", mode, "--over-sampling-batch-size", "8").determinism.active


def test_true_on_policy_with_mixed_precision_or_merged_lora_is_refused() -> None:
    with pytest.raises(ConfigError, match="--true-on-policy-mode and --bf16"):
        config("--rollout-num-engines", "1", "--true-on-policy-mode", "--bf16")
    with pytest.raises(ConfigError, match=r"--true-on-policy-mode and LoRA \(--lora-rank\): the engines serve merged"):
        config("--rollout-num-engines", "1", "--true-on-policy-mode", "--lora-rank", "4", "--target-modules", "all-linear")
    assert config("--rollout-num-engines", "1", "--deterministic-mode", "--lora-rank", "4",
                  "--target-modules", "all-linear").determinism.active


def test_our_engines_get_the_deterministic_flags_and_the_pinned_threads() -> None:
    node = plan("--rollout-num-engines", "2", "--true-on-policy-mode", "--log-probs-chunk-size", "64",
                "--attn-implementation", "eager").local
    for slot in node.rollout_engines:
        command = slot.command()
        assert "--enable-deterministic-inference" in command
        assert command[command.index("--rl-on-policy-target") + 1] == "fsdp"
        assert command[command.index("--log-probs-chunk-size") + 1] == "64"
        assert dict(slot.spec.env)["RAYLESS_ENGINE_THREADS"] == "1"
        assert command[command.index("--attn-implementation") + 1] == "eager"
    plain = plan("--rollout-num-engines", "1").local.rollout_engines[0]
    assert "--enable-deterministic-inference" not in plain.command() and plain.spec.env == ()


def test_sglang_gets_its_deterministic_inference_and_refuses_what_it_cannot_give() -> None:
    gpu = ["--rollout-num-gpus", "1", "--debug-rollout-only"]
    slot = plan(*gpu, "--deterministic-mode", gpus=1, sglang=True).local.rollout_engines[0]
    assert slot.choice.backend == "sglang" and "--enable-deterministic-inference" in slot.command()
    with pytest.raises(ConfigError, match="SGLang's batch-invariant kernels"):
        plan(*gpu, "--true-on-policy-mode", gpus=1, sglang=True)
    for flag in ("--sglang-attention-backend", "--sglang-decode-attention-backend"):
        with pytest.raises(ConfigError, match=rf"{flag} torch_native: SGLang has deterministic kernels only for"):
            plan(*gpu, "--deterministic-mode", flag, "torch_native", gpus=1, sglang=True)
    fa3 = plan(*gpu, "--deterministic-mode", "--sglang-attention-backend", "fa3", gpus=1, sglang=True)
    assert fa3.local.rollout_engines[0].command().count("--enable-deterministic-inference") == 1


def test_the_cli_exits_2_before_launching_anything() -> None:
    result = subprocess.run([sys.executable, "-m", "coordinator.cli", "train", *BASE, "--rollout-num-engines", "1",
                             "--true-on-policy-mode", "--async-rollout"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "--async-rollout" in result.stderr and "which weights a sample sees" in result.stderr


def test_an_sglang_older_than_its_deterministic_inference_is_refused() -> None:
    on = config("--rollout-num-gpus", "1", "--debug-rollout-only", "--deterministic-mode")
    with pytest.raises(ConfigError, match=r"on SGLang 0\.5\.2: its deterministic inference .* arrived in SGLang 0\.5\.3"):
        check_engine_backends(on, ["sglang"], sglang_version="0.5.2")
    with pytest.raises(ConfigError, match=r"on SGLang 0\.5\.2rc9:"):
        check_engine_backends(on, ["sglang"], sglang_version="0.5.2rc9")
    for version in ("0.5.3", "0.5.3rc0", "0.5.23", "1.0.0"):
        check_engine_backends(on, ["sglang"], sglang_version=version)
    check_engine_backends(on, ["rayless"], sglang_version="0.4.0")  # our engine: SGLang's version is beside the point
