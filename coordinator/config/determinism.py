"""The determinism slice: miles' `--deterministic-mode` and `--true-on-policy-mode`, and what they ask of the
engines and the ranks.

Owns these two flags, the contradictions that make them unable to hold (each refused at start-up, exit 2,
naming why), and the one mapping from them to the engines' extra flags (`engine_args`) and the ranks'
settings (`rank_settings`). `--true-on-policy-mode` implies `--deterministic-mode` (miles sets SGLang's
deterministic inference for it). What each side then does is in docs/deterministic.md.

Invariant: when `active` is false nothing here adds a flag, a setting or an environment variable.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from coordinator.config.fields import ConfigError, Slice, flag

if TYPE_CHECKING:
    from coordinator.config.settings import Config

#: SGLang's attention backends with deterministic kernels (sglang/srt/arg_groups/choices.py,
#: DETERMINISTIC_ATTENTION_BACKEND_CHOICES; `--enable-deterministic-inference` appeared in SGLang 0.5.3).
SGLANG_DETERMINISTIC_ATTENTION = ("ascend", "fa3", "fa4", "flashinfer", "intel_xpu", "triton")
#: SGLang's flags choosing an attention backend (as passed through, without the --sglang- prefix)
ATTENTION_FLAGS = ("--attention-backend", "--decode-attention-backend", "--prefill-attention-backend")
#: our engine's intra-op thread count (1 when unset); the ranks get the same count in their settings
THREADS_ENV = "RAYLESS_ENGINE_THREADS"


@dataclass(frozen=True)
class DeterminismConfig(Slice):
    TITLE = "determinism"
    DESCRIPTION = "deterministic runs and true on-policy logprobs (miles' flags)"

    deterministic_mode: bool = flag(False, help="Megatron/miles': two runs with the same seeds give the same "
                                    "metrics (batch-invariant engines, deterministic torch algorithms, one "
                                    "sample per micro-batch, one fixed thread count)")
    true_on_policy_mode: bool = flag(False, help="miles': the engine's logprobs of the sampled tokens equal the "
                                     "trainer's exactly (our engine rescores each finished sequence with the "
                                     "trainer's scoring function); implies --deterministic-mode")

    @property
    def active(self) -> bool:
        return self.deterministic_mode or self.true_on_policy_mode

    @property
    def flag_name(self) -> str:
        return "--true-on-policy-mode" if self.true_on_policy_mode else "--deterministic-mode"

    @staticmethod
    def threads() -> int:
        """The one intra-op thread count of every engine and rank: RAYLESS_ENGINE_THREADS (the engine's own
        variable; 1 when unset, as both sides default to)."""
        raw = os.environ.get(THREADS_ENV, "1")
        try:
            return max(1, int(raw))
        except ValueError:
            raise ConfigError(f"{THREADS_ENV}={raw!r}: the thread count of deterministic mode must be an "
                              "integer") from None


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


def rank_settings(config: Config) -> dict[str, Any]:
    """The ranks' settings this mode changes: one sample per micro-batch (the engine scores one sequence at a
    time; packing several into a row changes the attention kernel's shapes) and the pinned thread count."""
    if not config.determinism.active:
        return {}
    return {"deterministic_threads": DeterminismConfig.threads(), "micro_batch_size": 1}


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
        raise ConfigError(f"{name} and --over-sampling-batch-size {over} > --rollout-batch-size "
                          f"{rollout.rollout_batch_size}: the groups kept are the first to finish, set by "
                          "timing: make them equal or drop one")
    if config.cluster.rollout_external_engine_addrs and config.needs_engines:
        raise ConfigError(f"{name} and --rollout-external-engine-addrs: rayless cannot switch on deterministic "
                          "inference in engines it did not launch: let rayless launch them")
    if det.true_on_policy_mode and config.train.compute_dtype is not None:
        raise ConfigError(f"--true-on-policy-mode and --{'bf16' if config.train.bf16 else 'fp16'}: our engine "
                          "serves float32 weights, so its logprobs and a mixed-precision trainer's cannot be "
                          "equal: drop the precision flag")
    if det.true_on_policy_mode and config.lora.enabled and config.lora.lora_dropout:
        raise ConfigError(f"--true-on-policy-mode and --lora-dropout {config.lora.lora_dropout}: the trainer's "
                          "forward drops adapter inputs, the engine's does not: use --lora-dropout 0")


def check_engine_backends(config: Config, backends: Sequence[str]) -> None:
    """At planning time, once each group's backend is chosen: SGLang cannot give what these flags promise
    unless its own deterministic kernels run, and never the trainer's exact logprobs."""
    det = config.determinism
    if not det.active or "sglang" not in backends:
        return
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
