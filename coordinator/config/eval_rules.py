"""The cross-slice rules of miles' dedicated eval fleet (`--eval-num-gpus`, or rayless' `--eval-num-engines`),
appended to `rules.RULES`.

Owns `EVAL_FLEET_RULES`. Invariant: what miles refuses at start-up about its eval fleet (snapshot eval with
`--colocate` or a debug mode, `--eval-sglang-*` without a fleet, `--save-hf` reuse off the save cadence) is
refused here before anything launches, with miles' reason; the fleet's own flags given without a fleet warn.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING

from coordinator.config.fields import ConfigError, ConfigWarning

if TYPE_CHECKING:
    from coordinator.config.settings import Config

#: SGLang server arguments miles does not take under `--eval-sglang-` (its `_EVAL_SKIPPED_SERVER_ARGS`): each
#: is set by the launcher, `tp-size` by `--eval-num-gpus-per-engine`.
EVAL_SGLANG_SET_BY_LAUNCHER = ("model-path", "config", "trust-remote-code", "random-seed", "enable-memory-saver",
                               "port", "nnodes", "node-rank", "dist-init-addr", "gpu-id-step", "base-gpu-id",
                               "nccl-port", "skip-server-warmup", "enable-return-routed-experts",
                               "enable-return-indexer-topk", "tp-size")

FLEET_FLAGS = "--eval-num-gpus (or --eval-num-engines on CPU)"


def _fleet_asked(config: Config) -> bool:
    """The flags ask for a fleet (whether or not this run can start one)."""
    return bool(config.eval.eval_num_gpus or config.eval.eval_num_engines)


def eval_sglang_overrides_need_a_fleet(config: Config) -> None:
    """miles: `--eval-sglang-*` configures the dedicated eval fleet only."""
    overrides = [token[2:] for token in config.eval.eval_sglang_passthrough if token.startswith("--")]
    if overrides and not _fleet_asked(config):
        raise ConfigError(f"--eval-sglang-* configures the dedicated eval fleet, which needs {FLEET_FLAGS}: got "
                          f"{sorted(overrides)} with --eval-num-gpus 0")
    for name in overrides:
        if name.removeprefix("no-") in EVAL_SGLANG_SET_BY_LAUNCHER:
            what = ("--eval-num-gpus-per-engine sets the eval engines' TP size" if name.endswith("tp-size")
                    else "the launcher sets it for every engine")
            raise ConfigError(f"--eval-sglang-{name.removeprefix('no-')}: not an eval-fleet override ({what}, "
                              "as in miles)")


def eval_fleet_is_not_colocated(config: Config) -> None:
    if _fleet_asked(config) and config.cluster.colocate:
        raise ConfigError(f"{FLEET_FLAGS} with --colocate: snapshot eval is not supported with --colocate (miles' "
                          "rule); drop one")


def eval_fleet_is_not_in_a_debug_mode(config: Config) -> None:
    debug = config.debug
    mode = "--debug-train-only" if debug.debug_train_only else "--debug-rollout-only" \
        if debug.debug_rollout_only else None
    if _fleet_asked(config) and mode is not None:
        raise ConfigError(f"{FLEET_FLAGS} with {mode}: snapshot eval is not supported with "
                          "debug_train_only/debug_rollout_only (miles' rule); drop one")


def eval_fleet_flags_need_a_fleet(config: Config, *, checkpoint_eval_fn: bool | None = None) -> None:
    """The fleet's own flags without a fleet have no effect — except beside a CheckpointEvalFn, which uses the
    snapshot ones; whether the `--eval-function-path` is one is known once it is imported (`checks.preflight`
    calls this again with `checkpoint_eval_fn`)."""
    snapshot_flags = ("eval_hf_dir", "eval_keep_snapshots", "eval_overflow_policy")
    names = (*snapshot_flags, "eval_num_gpus_per_engine")
    if config.rollout.eval_function_path is not None:  # parse: the fleet's size flag; preflight: the rest
        names = ("eval_num_gpus_per_engine",) if checkpoint_eval_fn is None else \
            snapshot_flags if checkpoint_eval_fn is False else ()
    given = [f"--{name.replace('_', '-')}" for name in names if name in config.given]
    if given and not _fleet_asked(config):
        warnings.warn(f"{' / '.join(given)}: no effect without a dedicated eval fleet ({FLEET_FLAGS})",
                      ConfigWarning, stacklevel=3)


def eval_fleet_reuses_save_hf_on_its_cadence(config: Config) -> None:
    """miles: without --eval-hf-dir the fleet reuses the --save-hf checkpoints, so every evaluation must fall on
    a save."""
    evaluation, checkpoint = config.eval, config.checkpoint
    if not _fleet_asked(config) or evaluation.eval_hf_dir is not None or checkpoint.save_hf is None \
            or evaluation.eval_interval is None:
        return
    if checkpoint.save_interval is None or evaluation.eval_interval % checkpoint.save_interval:
        raise ConfigError("reusing --save-hf checkpoints for eval requires eval_interval to be a multiple of "
                          f"save_interval (got eval_interval={evaluation.eval_interval}, "
                          f"save_interval={checkpoint.save_interval}). Set --eval-hf-dir for independent "
                          "snapshots (miles' rule)")


EVAL_FLEET_RULES: tuple[Callable[[Config], None], ...] = (
    eval_sglang_overrides_need_a_fleet,
    eval_fleet_is_not_colocated,
    eval_fleet_is_not_in_a_debug_mode,
    eval_fleet_flags_need_a_fleet,
    eval_fleet_reuses_save_hf_on_its_cadence,
)


def checkpoint_eval_fn_fits(config: Config) -> None:
    """miles' rules for a `CheckpointEvalFn` `--eval-function-path` (its snapshot posture), checked once the hook
    is imported (`checks.preflight`): not with the eval fleet, with --eval-interval and a snapshot source, not
    colocated nor in a debug mode, and --save-hf reuse on its cadence."""
    path = config.rollout.eval_function_path
    if _fleet_asked(config):
        raise ConfigError(f"--eval-function-path {path} is a CheckpointEvalFn: --eval-num-gpus and a "
                          "CheckpointEvalFn --eval-function-path each select an eval backend; the fleet would "
                          "boot and then hand the work to the other one (miles' rule)")
    evaluation, checkpoint = config.eval, config.checkpoint
    if evaluation.eval_interval is None:
        raise ConfigError(f"--eval-function-path {path} is a CheckpointEvalFn: snapshot eval requires "
                          "--eval-interval (miles' rule)")
    if evaluation.eval_hf_dir is None and checkpoint.save_hf is None:
        raise ConfigError(f"--eval-function-path {path} is a CheckpointEvalFn: snapshot eval requires a snapshot "
                          "source: set --eval-hf-dir (staging exports) or --save-hf (reuse periodic HF "
                          "checkpoints) (miles' rule)")
    if config.cluster.colocate:
        raise ConfigError(f"--eval-function-path {path} is a CheckpointEvalFn: snapshot eval is not supported "
                          "with --colocate (miles' rule)")
    if config.debug.debug_train_only or config.debug.debug_rollout_only:
        raise ConfigError(f"--eval-function-path {path} is a CheckpointEvalFn: snapshot eval is not supported "
                          "with debug_train_only/debug_rollout_only (miles' rule)")
    if evaluation.eval_hf_dir is None and (checkpoint.save_interval is None
                                           or evaluation.eval_interval % checkpoint.save_interval):
        raise ConfigError("reusing --save-hf checkpoints for eval requires eval_interval to be a multiple of "
                          f"save_interval (got eval_interval={evaluation.eval_interval}, "
                          f"save_interval={checkpoint.save_interval}). Set --eval-hf-dir for independent "
                          "snapshots (miles' rule)")
