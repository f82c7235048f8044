"""The eval slice: what is evaluated, how often, with which sampling, and where (the rollout engines, or a
dedicated eval fleet).

Owns these flags and `dataset_specs` (the datasets of `--eval-config`, else the `--eval-prompt-data` NAME PATH
pairs). Invariants: `--eval-prompt-data` holds whole pairs; an `--eval-config` is read and checked with the
slice (`coordinator.config.eval_file`); one flag sizes the eval fleet (`--eval-num-engines` or
`--eval-num-gpus`, in engines of `--eval-num-gpus-per-engine` GPUs); `eval_sglang_passthrough` is not a flag: the
parser fills it from `--eval-sglang-*` (miles' per-fleet overrides of `--sglang-*`). Unset sampling flags fall
back to the rollout's (`EvalSettings.from_slices`). Rules across slices: `coordinator.config.eval_rules`.
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from coordinator.config.eval_file import BASE64_PREFIX, EvalDatasetSpec, read_eval_config
from coordinator.config.fields import ConfigError, ConfigWarning, Slice, flag


@dataclass(frozen=True)
class EvalConfig(Slice):
    TITLE = "eval"
    DESCRIPTION = "evaluation (on the rollout engines, or a dedicated eval fleet) and what it evaluates"

    eval_num_gpus: int = flag(0, help="GPUs for a dedicated eval fleet", minimum=0)
    eval_num_gpus_per_engine: int = flag(1, help="GPUs per eval engine (its TP size; miles' flag, independent of "
                                         "--rollout-num-gpus-per-engine)", minimum=1)
    eval_num_engines: int = flag(0, help="CPU engines for a dedicated eval fleet", minimum=0)
    eval_hf_dir: str | None = flag(None, help="where the eval fleet's weight snapshots go, one per evaluated step: "
                                   "DIR/step_<rollout_id> (miles' flag; a tmpfs path is fine; default: "
                                   "<run_dir>/eval_weights)", metavar="DIR")
    eval_keep_snapshots: int = flag(2, help="snapshots of settled evaluations kept on disk; each settled evaluation "
                                    "retires one (miles' flag)", minimum=0)
    eval_overflow_policy: str = flag("backpressure", help="an evaluation due while --eval-max-in-flight are "
                                     "pending: backpressure waits for the oldest, skip drops the new one and logs "
                                     "eval/skipped_busy (the final evaluation is never skipped)",
                                     choices=("backpressure", "skip"))
    eval_interval: int | None = flag(None, help="evaluate every K rollouts", minimum=1)
    eval_prompt_data: tuple[str, ...] = flag((), help="NAME PATH pairs", metavar="NAME PATH")
    eval_config: str | None = flag(None, help="slime's eval YAML (defaults + datasets), a file or base64:<yaml>; "
                                   "replaces --eval-prompt-data", metavar="FILE")
    skip_eval_before_train: bool = flag(False, help="no evaluation before the first rollout (default: evaluate "
                                                    "at rollout 0, as slime)")
    n_samples_per_eval_prompt: int = flag(1, help="samples per eval prompt (pass@k uses them)", minimum=1)
    eval_temperature: float | None = flag(None, help="eval sampling temperature (default: rollout's)", minimum=0)
    eval_top_p: float | None = flag(None, help="eval top-p (default: rollout's)", above=0, maximum=1)
    eval_top_k: int | None = flag(None, help="eval top-k (default: rollout's; -1 = off)", minimum=1, also=(-1,))
    eval_max_response_len: int | None = flag(None, help="eval max new tokens (default: rollout's)", minimum=1)
    eval_max_context_len: int | None = flag(None, help="eval prompt + response length cap: max new tokens are "
                                            "clipped to it (default: --rollout-max-context-len)", minimum=1)
    eval_input_key: str | None = flag(None, help="prompt field of eval files (default: --input-key)", secret=False)
    eval_label_key: str | None = flag(None, help="label field of eval files (default: --label-key)", secret=False)
    eval_tool_key: str | None = flag(None, help="tools field of eval files, handed to the chat template "
                                     "(default: --tool-key)", secret=False)
    eval_reward_key: str | None = flag(None, help="entry of a dict reward eval metrics use (default: --reward-key)",
                                       secret=False)
    eval_max_in_flight: int = flag(2, help="evaluations pending (running or waiting) at once on the eval fleet; "
                                   "one more due follows --eval-overflow-policy", minimum=1)
    eval_allow_partial_fleet: bool = flag(False, help="evaluate on the eval engines that are alive when not all "
                                                      "came back (default: skip the eval as unhealthy)")
    # Filled by the parser from `--eval-sglang-*` flags (prefix `--eval-sglang-` made `--`); not a flag itself.
    eval_sglang_passthrough: tuple[str, ...] = field(default=())

    def check(self) -> None:
        if len(self.eval_prompt_data) % 2:
            raise ConfigError("--eval-prompt-data takes pairs: NAME PATH [NAME PATH ...]")
        if self.eval_num_engines and self.eval_num_gpus:
            raise ConfigError("--eval-num-engines and --eval-num-gpus both size the eval fleet: give one")
        if self.eval_config is not None:
            self._read_eval_config()  # a broken file stops the run here, before anything starts
            if self.eval_prompt_data:
                warnings.warn("--eval-config replaces --eval-prompt-data (as in slime): the pairs given to "
                              "--eval-prompt-data are not evaluated", ConfigWarning, stacklevel=3)

    def _read_eval_config(self) -> tuple[EvalDatasetSpec, ...]:
        assert self.eval_config is not None
        value = self.eval_config
        stamp: tuple[int, int] | None = None
        if not value.startswith(BASE64_PREFIX) and Path(value).is_file():
            status = Path(value).stat()
            stamp = (status.st_mtime_ns, status.st_size)  # an edited file is read again
        return _cached_eval_config(value, stamp)

    @property
    def eval_datasets(self) -> list[tuple[str, str]]:
        """(name, path) of every dataset evaluated."""
        return [(spec.name, spec.path) for spec in self.dataset_specs]

    @property
    def dataset_specs(self) -> tuple[EvalDatasetSpec, ...]:
        """The eval datasets: `--eval-config`'s when given, else one per `--eval-prompt-data` pair."""
        if self.eval_config is not None:
            return self._read_eval_config()
        items = list(self.eval_prompt_data)
        return tuple(EvalDatasetSpec(name=items[i], path=items[i + 1]) for i in range(0, len(items) - 1, 2))


@functools.lru_cache(maxsize=8)
def _cached_eval_config(value: str, stamp: tuple[int, int] | None) -> tuple[EvalDatasetSpec, ...]:
    """Read once per value: the slice's check, preflight and the eval builders all ask for the datasets."""
    return read_eval_config(value)
