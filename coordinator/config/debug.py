"""The debug slice: dumping rollouts, replaying dumps instead of generating, and running one half alone.

Owns these flags. Invariants: dump templates contain `{rollout_id}`; at most one half is switched off
(`--debug-train-only` / `--debug-rollout-only` / replay, which implies train-only). The modes these flags
select are derived facts of `Config` (`replay_mode`, `train_only`, `needs_engines`, `needs_train_ranks`).
"""

from __future__ import annotations

from dataclasses import dataclass

from coordinator.config import values
from coordinator.config.fields import ConfigError, Slice, flag


@dataclass(frozen=True)
class DebugConfig(Slice):
    TITLE = "debug"
    DESCRIPTION = "rollout dumps, replay, and running one half alone"

    save_debug_rollout_data: str | None = flag(None, help="dump every rollout to this template with {rollout_id}",
                                               parse=values.rollout_id_template, metavar="TEMPLATE")
    dump_details: str | None = flag(None, help="miles': dump every rollout to DIR/rollout_data/{rollout_id}.rld "
                                    "(sets --save-debug-rollout-data; the ranks' tensors are not dumped)",
                                    metavar="DIR")
    load_debug_rollout_data: str | None = flag(None, help="replay dumps from this template instead of generating",
                                               parse=values.rollout_id_template, metavar="TEMPLATE")
    load_debug_rollout_data_subsample: float | None = flag(None, help="keep this fraction of each replayed "
                                                           "rollout", above=0, maximum=1)
    debug_train_only: bool = flag(False, help="start no engines")
    debug_rollout_only: bool = flag(False, help="start no training ranks")
    dry_run: bool = flag(False, help="check flags, data files and keys, tokenizer, hooks and checkpoint paths, "
                         "print the placement plan (every process: GPUs, ports, environment, command line) and "
                         "exit without launching anything")
    ci_test: bool = flag(False, help="CI mode: with rollout FT, kill one rollout engine at rollout 1 to exercise "
                         "recovery")

    def check(self) -> None:
        if self.debug_train_only and self.debug_rollout_only:
            raise ConfigError("--debug-train-only and --debug-rollout-only contradict: each disables the other half")
        if self.load_debug_rollout_data is not None and self.debug_rollout_only:
            raise ConfigError("--load-debug-rollout-data replays dumps into training; --debug-rollout-only "
                              "disables training: choose one")
        if self.load_debug_rollout_data is None and self.load_debug_rollout_data_subsample is not None:
            raise ConfigError("--load-debug-rollout-data-subsample needs --load-debug-rollout-data")
