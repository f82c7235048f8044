"""The eval slice: a dedicated eval fleet, what it evaluates, how often, and with which sampling.

Owns these flags and `eval_datasets` (the NAME PATH pairs). Invariants: `--eval-prompt-data` holds whole
pairs; one flag sizes the eval fleet (`--eval-num-engines` or `--eval-num-gpus`). Unset sampling flags fall
back to the rollout's (`EvalSettings.from_slices`).
"""

from __future__ import annotations

from dataclasses import dataclass

from coordinator.config.fields import ConfigError, Slice, flag


@dataclass(frozen=True)
class EvalConfig(Slice):
    TITLE = "eval"
    DESCRIPTION = "a dedicated eval fleet and what it evaluates"

    eval_num_gpus: int = flag(0, help="GPUs for a dedicated eval fleet", minimum=0)
    eval_num_engines: int = flag(0, help="CPU engines for a dedicated eval fleet", minimum=0)
    eval_interval: int | None = flag(None, help="evaluate every K rollouts", minimum=1)
    eval_prompt_data: tuple[str, ...] = flag((), help="NAME PATH pairs", metavar="NAME PATH")
    n_samples_per_eval_prompt: int = flag(1, help="samples per eval prompt (pass@k uses them)", minimum=1)
    eval_temperature: float | None = flag(None, help="eval sampling temperature (default: rollout's)", minimum=0)
    eval_top_p: float | None = flag(None, help="eval top-p (default: rollout's)", above=0, maximum=1)
    eval_max_response_len: int | None = flag(None, help="eval max new tokens (default: rollout's)", minimum=1)
    eval_max_in_flight: int = flag(1, help="evals running at once; the oldest waiting one is skipped", minimum=1)
    eval_allow_partial_fleet: bool = flag(False, help="evaluate on the eval engines that are alive when not all "
                                                      "came back (default: skip the eval as unhealthy)")

    def check(self) -> None:
        if len(self.eval_prompt_data) % 2:
            raise ConfigError("--eval-prompt-data takes pairs: NAME PATH [NAME PATH ...]")
        if self.eval_num_engines and self.eval_num_gpus:
            raise ConfigError("--eval-num-engines and --eval-num-gpus both size the eval fleet: give one")

    @property
    def eval_datasets(self) -> list[tuple[str, str]]:
        items = list(self.eval_prompt_data)
        return [(items[i], items[i + 1]) for i in range(0, len(items) - 1, 2)]
