"""The determinism slice: miles' `--deterministic-mode` and `--true-on-policy-mode`, and what they ask of the
ranks (`settings`, and the `active` flag `coordinator.train.settings` gives the batching). `--true-on-policy-mode` implies `--deterministic-mode` (miles sets SGLang's
deterministic inference for it). The rules reading other slices, and the engines' flags, are
`determinism_rules`'. What each side then does: docs/deterministic.md.

Invariant: when `active` is false nothing here adds a setting.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from coordinator.config.fields import ConfigError, Slice, flag
from workers.protocol.train_settings import DeterminismSettings

#: our engine's intra-op thread count (1 when unset); the ranks get the same count in their settings
THREADS_ENV = "RAYLESS_ENGINE_THREADS"


@dataclass(frozen=True)
class DeterminismConfig(Slice):
    TITLE = "determinism"
    DESCRIPTION = "deterministic runs and true on-policy logprobs (miles' flags)"

    deterministic_mode: bool = flag(False, help="Megatron/miles': two runs with the same seeds give the same "
                                    "metrics (batch-invariant engines, deterministic torch algorithms, one "
                                    "sample per micro-batch, one fixed thread count); with --over-sampling-batch-size "
                                    "above --rollout-batch-size each sample is, not which groups are kept")
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

    def settings(self) -> DeterminismSettings:
        """The ranks' determinism component: the pinned thread count, or off. (The mode's other rule for the
        ranks, one sample per micro-batch, is the batching's: `coordinator.train.settings` passes `active`.)"""
        return DeterminismSettings(threads=self.threads()) if self.active else DeterminismSettings()
