"""The cross-slice side of deterministic runs: the contradictions under which `--deterministic-mode` /
`--true-on-policy-mode` cannot hold (each refused at start-up, exit 2, naming why), what holds only per sample
(over-sampling: a warning, as miles runs it), and the engines' extra flags and environment in this mode
(`engine_args`, `engine_env`, read by the placement plan).

Invariant: when the mode is off nothing here refuses, adds a flag or an environment variable.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING

from coordinator.config.determinism import THREADS_ENV, DeterminismConfig
from coordinator.config.fields import ConfigError, ConfigWarning

if TYPE_CHECKING:
    from coordinator.config.settings import Config

#: SGLang's attention backends with deterministic kernels (sglang/srt/arg_groups/choices.py,
#: DETERMINISTIC_ATTENTION_BACKEND_CHOICES; `--enable-deterministic-inference` appeared in SGLang 0.5.3).
SGLANG_DETERMINISTIC_ATTENTION = ("ascend", "fa3", "fa4", "flashinfer", "intel_xpu", "triton")
#: the first SGLang release with `--enable-deterministic-inference`
SGLANG_DETERMINISTIC_SINCE = (0, 5, 3)
#: SGLang's flags choosing an attention backend (as passed through, without the --sglang- prefix)
ATTENTION_FLAGS = ("--attention-backend", "--decode-attention-backend", "--prefill-attention-backend")


def engine_args(config: Config, backend: str) -> tuple[str, ...]:
    """What a launched engine of `backend` ("rayless" or "sglang") adds to its command line in this mode."""
    det = config.determinism
    if not det.active:
        return ()
    if backend == "sglang":
        given = config.sglang.sglang_passthrough
        return () if "--enable-deterministic-inference" in given else ("--enable-deterministic-inference",)
    extra = ["--enable-deterministic-inference"]
    if det.true_on_policy_mode:
        extra += ["--rl-on-policy-target", "fsdp"]
        chunk = config.train.log_probs_chunk_size
        if chunk is not None:
            extra += ["--log-probs-chunk-size", str(chunk)]
        if config.train.attn_implementation:  # the trainer's attention kernel, so both run the same one
            extra += ["--attn-implementation", config.train.attn_implementation]
    return tuple(extra)


def engine_env(config: Config) -> tuple[tuple[str, str], ...]:
    return ((THREADS_ENV, str(DeterminismConfig.threads())),) if config.determinism.active else ()


def deterministic_runs_can_hold(config: Config) -> None:
    """The cross-slice rule: flags under which two runs (or engine and trainer) cannot agree are refused."""
    det = config.determinism
    if not det.active:
        return
    name, rollout = det.flag_name, config.rollout
    if rollout.async_rollout or rollout.fully_async:
        raise ConfigError(f"{name} and --async-rollout/--fully-async: with asynchronous generation a weight "
                          "update lands mid-generation at a moment set by training speed, so which weights a "
                          "sample sees differs between runs: drop one")
    if rollout.partial_rollout:
        raise ConfigError(f"{name} and --partial-rollout: which stragglers are aborted, and how far they got, "
                          "depends on timing: drop one")
    over = rollout.over_sampling_batch_size
    if over is not None and rollout.rollout_batch_size is not None and over > rollout.rollout_batch_size:
        # Not refused: miles' own scripts pair the mode with dynamic sampling (examples/lora, run_mcore_fsdp.py,
        # run_deepseek_v4.py), and what the mode promises per sample still holds: every kept group is generated
        # whole by the current weights, decoded batch-invariantly and (true-on-policy) scored as the ranks do.
        warnings.warn(f"{name} with --over-sampling-batch-size {over} > --rollout-batch-size "
                      f"{rollout.rollout_batch_size}: which groups are kept is set by which finish first, so two "
                      "runs may train on different groups; each sample is still generated and scored "
                      "deterministically (make the two equal for identical runs)", ConfigWarning, stacklevel=3)
    if config.cluster.rollout_external_engine_addrs and config.needs_engines:
        raise ConfigError(f"{name} and --rollout-external-engine-addrs: rayless cannot switch on deterministic "
                          "inference in engines it did not launch: let rayless launch them")
    if det.true_on_policy_mode and config.train.compute_dtype is not None:
        raise ConfigError(f"--true-on-policy-mode and --{'bf16' if config.train.bf16 else 'fp16'}: our engine "
                          "serves float32 weights, so its logprobs and a mixed-precision trainer's cannot be "
                          "equal: drop the precision flag")
    if det.true_on_policy_mode and config.lora.enabled:
        raise ConfigError("--true-on-policy-mode and LoRA (--lora-rank): the engines serve merged weights "
                          "(W + s·BA), the trainer computes W·x + s·B(A·x), so the sums differ in the last bits: "
                          "drop one (--deterministic-mode alone holds with LoRA)")
    if config.sglang.router_address is not None and config.needs_engines:
        raise ConfigError(f"{name} and --sglang-router-ip/--sglang-router-port: a running router may route to "
                          "engines rayless did not launch, without deterministic inference: let rayless launch "
                          "the router (--use-sglang-router) or drop one")


def installed_sglang_version() -> str | None:
    """The version of the sglang distribution installed here (read from its metadata, never imported)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("sglang")
    except PackageNotFoundError:
        return None


def _release(text: str) -> tuple[int, ...]:
    """'0.5.3rc0' → (0, 5, 3): the leading digits of the first three parts."""
    parts = []
    for piece in text.split(".")[:3]:
        digits = re.match(r"\d+", piece)
        if digits is None:
            break
        parts.append(int(digits.group()))
    return tuple(parts)


def check_engine_backends(config: Config, backends: Sequence[str], *, sglang_version: str | None = None) -> None:
    """At planning time, once each group's backend is chosen: SGLang cannot give what these flags promise
    unless its own deterministic kernels run, and never the trainer's exact logprobs. `sglang_version`: the
    installed one, where it is known."""
    det = config.determinism
    if not det.active or "sglang" not in backends:
        return
    if sglang_version is not None and _release(sglang_version) < SGLANG_DETERMINISTIC_SINCE:
        raise ConfigError(f"{det.flag_name} on SGLang {sglang_version}: its deterministic inference "
                          "(--enable-deterministic-inference) arrived in SGLang 0.5.3: upgrade SGLang, or use our "
                          "engine (--engine-backend rayless)")
    if det.true_on_policy_mode:
        raise ConfigError("--true-on-policy-mode on SGLang engines: equal logprobs need the trainer to run "
                          "SGLang's batch-invariant kernels (miles patches its FSDP model with them; "
                          "--sglang-rl-on-policy-target fsdp), and rayless' trainer runs PyTorch's own: use "
                          "our engine (--engine-backend rayless), or --deterministic-mode alone")
    given = config.sglang.sglang_passthrough
    for index, arg in enumerate(given):
        name, _, value = arg.partition("=")
        if name not in ATTENTION_FLAGS:
            continue
        backend = value or (given[index + 1] if index + 1 < len(given) else "")
        if backend not in SGLANG_DETERMINISTIC_ATTENTION:
            raise ConfigError(f"--deterministic-mode and --sglang-{name[2:]} {backend}: SGLang has "
                              f"deterministic kernels only for {', '.join(SGLANG_DETERMINISTIC_ATTENTION)} "
                              "(--enable-deterministic-inference, SGLang >= 0.5.3): pick one of them")
