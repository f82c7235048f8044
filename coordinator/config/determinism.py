"""The determinism slice: miles' `--deterministic-mode` and `--true-on-policy-mode`, and what they ask of the
ranks (`rank_settings`). `--true-on-policy-mode` implies `--deterministic-mode` (miles sets SGLang's
deterministic inference for it). The rules reading other slices, and the engines' flags, are
`determinism_rules`'. What each side then does: docs/deterministic.md.

Invariant: when `active` is false nothing here adds a setting.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import msgspec

from coordinator.config.fields import ConfigError, Slice, flag
from workers.protocol.train_settings import DeterminismSettings, TrainSettings

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

    def rank_settings(self, settings: TrainSettings) -> TrainSettings:
        """The ranks' settings this mode changes: one sample per micro-batch (the engine scores one sequence at a
        time; packing several into a row changes the attention kernel's shapes) and the pinned thread count."""
        if not self.active:
            return settings
        return settings.replace(determinism=DeterminismSettings(threads=self.threads()),
                                batching=msgspec.structs.replace(settings.batching, micro_batch_size=1))
