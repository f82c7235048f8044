"""miles' `CheckpointEvalFn` as `--eval-function-path`: recognised once imported (start-up checks), and its
snapshot posture refused where miles refuses it — beside the eval fleet, without --eval-interval or a snapshot
source, colocated, in a debug mode, or reusing --save-hf off its cadence. (The real run: test_eval_fleet.py.)"""

from __future__ import annotations

import re
from contextlib import nullcontext

import pytest

from coordinator.checks.preflight import check_hooks
from coordinator.config import ConfigError, parse_config
from coordinator.config.fields import ConfigWarning
from coordinator.hooks import CheckpointEvalFn
from coordinator.hooks.checkpoint_eval import is_checkpoint_eval_fn
from tests.support.miles_rollout_fns import SnapshotReadingEvalFn, VerifiersShapedRolloutFn

BASE = ["--hf-checkpoint", "/m", "--rollout-batch-size", "2", "--num-rollout", "2", "--prompt-data",
        "builtin:first_digit", "--eval-prompt-data", "digits", "builtin:first_digit",
        "--eval-function-path", "tests.support.miles_rollout_fns:SnapshotReadingEvalFn"]


def test_a_checkpoint_eval_fn_is_told_from_a_rollout_class() -> None:
    assert is_checkpoint_eval_fn(SnapshotReadingEvalFn) and issubclass(SnapshotReadingEvalFn, CheckpointEvalFn)
    assert not is_checkpoint_eval_fn(VerifiersShapedRolloutFn) and not is_checkpoint_eval_fn(SnapshotReadingEvalFn(
        type("Input", (), {"args": None})()))  # an instance is not the class --eval-function-path names


def test_with_a_snapshot_source_and_an_interval_it_passes_the_start_up_checks() -> None:
    config = parse_config([*BASE, "--rollout-num-engines", "1", "--eval-interval", "1", "--eval-hf-dir", "/tmp/e"])
    notes = check_hooks(config)
    assert any("--eval-function-path" in note and "miles' form" in note for note in notes), notes


@pytest.mark.parametrize(("flags", "match"), [
    (["--rollout-num-engines", "1", "--eval-hf-dir", "/tmp/e"], "snapshot eval requires --eval-interval"),
    (["--rollout-num-engines", "1", "--eval-interval", "1"], "requires a snapshot source: set --eval-hf-dir"),
    (["--rollout-num-engines", "1", "--eval-interval", "1", "--eval-hf-dir", "/tmp/e", "--debug-rollout-only"],
     "not supported with debug_train_only/debug_rollout_only"),
    (["--rollout-num-engines", "1", "--eval-interval", "1", "--eval-hf-dir", "/tmp/e", "--colocate"],
     "not supported with --colocate"),
    (["--rollout-num-engines", "1", "--eval-interval", "2", "--save-hf", "/tmp/hf/{rollout_id}",
      "--save-interval", "3"], "eval_interval to be a multiple of save_interval (got eval_interval=2, "
                               "save_interval=3)"),
])
def test_miles_refusals_of_the_snapshot_posture(flags: list[str], match: str) -> None:
    with pytest.warns(ConfigWarning) if "--eval-interval" not in flags else nullcontext():
        config = parse_config([*BASE, *flags])
    with pytest.raises(ConfigError, match=re.escape(match)):
        check_hooks(config)


def test_beside_the_eval_fleet_it_is_refused_as_miles_does() -> None:
    with pytest.warns(ConfigWarning, match="a CheckpointEvalFn there is refused at start-up"):
        config = parse_config([*BASE, "--rollout-num-engines", "1", "--eval-num-engines", "1", "--eval-interval",
                               "1"])
    with pytest.raises(ConfigError, match="--eval-num-gpus and a CheckpointEvalFn --eval-function-path each "
                                          "select an eval backend"):
        check_hooks(config)


def test_snapshot_flags_beside_a_rollout_style_eval_function_warn_that_they_do_nothing() -> None:
    config = parse_config([*BASE[:-1], "tests.support.miles_rollout_fns:VerifiersShapedRolloutFn",
                           "--rollout-num-engines", "1", "--eval-interval", "1", "--eval-hf-dir", "/tmp/e"])
    with pytest.warns(ConfigWarning, match="--eval-hf-dir: no effect without a dedicated eval fleet"):
        check_hooks(config)
