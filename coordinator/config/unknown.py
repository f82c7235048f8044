"""The report of command-line flags rayless does not know: one per line, grouped by where they come from,
each with the closest flag we do know.

Owns `unknown_flags_report` (the one place that message is written) and the small lists that recognise a
flag's origin: Megatron-LM's (slime and miles pass them to their Megatron trainer) and slime/miles' own.
The lists recognise; they accept nothing. A value following an unknown flag is never shown (it may be a
secret).
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable, Sequence

MEGATRON_PREFIXES = (
    "--tensor-model-parallel", "--pipeline-model-parallel", "--context-parallel", "--expert-model-parallel",
    "--expert-tensor-parallel", "--decoder-", "--encoder-", "--moe-", "--recompute-", "--num-layers",
    "--num-attention-heads", "--num-query-groups", "--rotary-", "--attention-", "--hidden-dropout",
    "--overlap-", "--use-distributed-optimizer", "--distributed-", "--accumulate-allreduce",
)
MEGATRON_FLAGS = frozenset({
    "--hidden-size", "--ffn-hidden-size", "--group-query-attention", "--kv-channels", "--swiglu",
    "--use-rotary-position-embeddings", "--disable-bias-linear", "--add-qkv-bias", "--normalization",
    "--norm-epsilon", "--untie-embeddings-and-output-weights", "--vocab-size",
    "--make-vocab-size-divisible-by", "--qk-layernorm", "--seq-length", "--max-position-embeddings",
    "--position-embedding-type", "--sequence-parallel", "--micro-batch-size", "--use-dynamic-batch-size",
    "--bf16", "--fp16", "--optimizer-cpu-offload", "--use-precision-aware-optimizer", "--use-flash-attn",
    "--no-masked-softmax-fusion", "--no-bias-swiglu-fusion", "--no-rope-fusion", "--transformer-impl",
    "--tokenizer-type", "--tokenizer-model", "--ckpt-format", "--no-load-optim", "--no-load-rng",
    "--no-save-optim", "--spec", "--init-method-std", "--calculate-per-token-loss", "--log-interval",
})
SLIME_FLAGS = frozenset({
    "--kl-loss-coef", "--kl-loss-type", "--optimizer", "--adam-beta1", "--adam-beta2", "--adam-eps",
    "--lr-decay-style", "--min-lr", "--lr-decay-iters", "--ref-load", "--save-retain-interval",
    "--wandb-project", "--wandb-group", "--wandb-team", "--wandb-host", "--disable-wandb-random-suffix",
    "--use-tis", "--num-steps-per-rollout", "--balance-data", "--normalize-advantages",
    "--eval-config", "--eval-top-k", "--rm-url", "--num-epoch", "--rollout-global-dataset",
    "--buffer-filter-path", "--start-rollout-id", "--keep-old-actor", "--offload",
    "--use-miles-router", "--true-on-policy-mode", "--train-backend", "--rollout-external",
    "--sglang-router-ip", "--sglang-router-port", "--use-wandb-offline", "--loss-type", "--custom-loss-function-path",
    "--use-dynamic-global-batch-size", "--rollout-num-epoch", "--eval-input-key", "--eval-label-key",
    "--tis-clip", "--tis-clip-low", "--use-routing-replay", "--use-rollout-routing-replay", "--prefill-num-servers",
})
ORIGINS = (
    ("Megatron-LM", "Megatron-LM flags rayless does not know; the ones slime/miles scripts use are accepted, "
                    "see the Megatron-LM group of --help"),
    ("slime/miles", "slime/miles flags rayless does not support"),
    ("unknown", "not a flag of rayless, slime, miles or Megatron-LM"),
)
_NUMBER = re.compile(r"^-\d|^-\.\d")


def origin_of(flag: str) -> str:
    if flag in MEGATRON_FLAGS or flag.startswith(MEGATRON_PREFIXES):
        return "Megatron-LM"
    if flag in SLIME_FLAGS:
        return "slime/miles"
    return "unknown"


def closest_flag(flag: str, known: Iterable[str]) -> str | None:
    """The known flag `flag` most likely meant: one it abbreviates, else the nearest by spelling."""
    known = sorted(known)
    extensions = [candidate for candidate in known if candidate.startswith(flag + "-")]
    if len(extensions) == 1:
        return extensions[0]
    matches = difflib.get_close_matches(flag, known, n=1, cutoff=0.6)
    return matches[0] if matches else None


def unknown_flags_report(tokens: Sequence[str], known: Iterable[str]) -> str:
    """The message for the command-line tokens argparse did not take (flags and their values)."""
    known = list(known)
    flags: list[str] = []
    stray: list[str] = []
    after_flag = False
    for token in tokens:
        if token.startswith("-") and not _NUMBER.match(token):
            name = token.partition("=")[0]
            if name not in flags:
                flags.append(name)
            after_flag = True
        elif not after_flag:
            stray.append(token)
    lines = [f"{len(flags)} unrecognised flag(s):" if flags else "unrecognised arguments:"]
    width = max((len(flag) for flag in flags), default=0)
    for origin, why in ORIGINS:
        mine = [flag for flag in flags if origin_of(flag) == origin]
        if not mine:
            continue
        lines.append(f"  {origin} ({why}):")
        for flag in mine:
            suggestion = closest_flag(flag, known)
            hint = f"   did you mean {suggestion}?" if suggestion else ""
            lines.append(f"    {flag:<{width}}{hint}".rstrip())
    if stray:
        lines.append("  values without a flag: " + " ".join(repr(value) for value in stray))
    return "\n".join(lines)
