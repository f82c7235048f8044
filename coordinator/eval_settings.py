"""What an evaluation runs on: the eval flags (`EvalSettings`) and the eval datasets they name.

Owns the one mapping from the eval slice (and the rollout and sglang flags it falls back to) to the eval
fleet's settings (`EvalSettings.from_slices`: the fleet never sees the whole Config) and the loading of
`--eval-prompt-data NAME PATH ...` with the reward that scores each dataset. Invariants: every dataset has a reward (else a ValueError naming the flag to give);
a `builtin:<task>` dataset is always the same 32 prompts for one `--rollout-seed` and is scored by its task's
own rm type; a file dataset by the run's reward flags (`RewardChoice`, the rule the rollout uses).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from coordinator.rollout.data_source import PromptRecord, read_prompt_file
from coordinator.rollout.reward_choice import RewardChoice
from coordinator.rollout.rewards import RewardModel
from coordinator.rollout.tasks import builtin_task_name, make_task_prompts

if TYPE_CHECKING:
    from coordinator.config import EvalConfig, RolloutConfig, SglangConfig

BUILTIN_EVAL_PROMPTS = 32
#: Base sampling seed of eval requests: a sample's seed depends on the evaluation, prompt and sample only.
EVAL_SEED = 0


@dataclass(frozen=True)
class EvalSettings:
    """The flags the eval fleet reads; `from_slices` is the one place they are taken from the run's config."""

    interval: int | None
    datasets: tuple[tuple[str, str], ...]  # --eval-prompt-data NAME PATH pairs
    n_samples: int
    max_in_flight: int
    temperature: float
    top_p: float
    max_response_len: int
    server_concurrency: int  # --sglang-server-concurrency: requests in flight per engine
    hf_checkpoint: str  # pinned as version "0" when there is no training to export weights
    builtin_prompt_seed: int  # builtin:<task> eval prompts are drawn with --rollout-seed + 1
    input_key: str = "prompt"
    label_key: str | None = None
    metadata_key: str | None = None
    reward: RewardChoice = field(default_factory=RewardChoice)  # for file datasets, resolved for --prompt-data
    allow_partial_fleet: bool = False  # --eval-allow-partial-fleet

    @classmethod
    def from_slices(cls, evaluation: EvalConfig, *, rollout: RolloutConfig, sglang: SglangConfig) -> EvalSettings:
        """The eval slice's flags; unset sampling flags fall back to the rollout's."""
        return cls(
            interval=evaluation.eval_interval,
            datasets=tuple(evaluation.eval_datasets),
            n_samples=evaluation.n_samples_per_eval_prompt,
            max_in_flight=evaluation.eval_max_in_flight,
            temperature=(evaluation.eval_temperature if evaluation.eval_temperature is not None
                         else rollout.rollout_temperature),
            top_p=evaluation.eval_top_p if evaluation.eval_top_p is not None else rollout.rollout_top_p,
            max_response_len=evaluation.eval_max_response_len or rollout.rollout_max_response_len,
            server_concurrency=sglang.sglang_server_concurrency,
            hf_checkpoint=str(rollout.hf_checkpoint),
            builtin_prompt_seed=rollout.rollout_seed + 1,
            input_key=rollout.input_key,
            label_key=rollout.label_key,
            metadata_key=rollout.metadata_key,
            reward=RewardChoice.from_rollout(rollout).resolved(rollout.prompt_data),
            allow_partial_fleet=evaluation.eval_allow_partial_fleet,
        )


@dataclass
class EvalDataset:
    name: str
    records: list[PromptRecord]
    reward_model: RewardModel


def load_eval_datasets(settings: EvalSettings) -> list[EvalDataset]:
    """`--eval-prompt-data NAME PATH ...`: JSONL/Parquet files, or `builtin:<task>` (32 prompts, seed + 1)."""
    datasets = []
    for name, path in settings.datasets:
        task = builtin_task_name(path)
        if task is not None:
            records = make_task_prompts(task, BUILTIN_EVAL_PROMPTS, settings.builtin_prompt_seed)
            # a built-in task is scored by its own rm type, whatever the run's reward flags say
            reward_model = RewardChoice(reward_key=settings.reward.reward_key).resolved(path).model()
        else:
            records = read_prompt_file(path, input_key=settings.input_key, label_key=settings.label_key,
                                       metadata_key=settings.metadata_key)
            reward_model = settings.reward.model()
        if reward_model is None:
            raise ValueError(f"--eval-prompt-data {name} {path}: no reward to score it; give --rm-type or "
                             "--custom-rm-path")
        datasets.append(EvalDataset(name=name, records=records, reward_model=reward_model))
    return datasets
