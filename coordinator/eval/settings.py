"""What an evaluation runs: the eval flags (`EvalSettings`) and each dataset, resolved and loaded.

Owns the one mapping from the eval slice (and the rollout and sglang flags it falls back to) to the settings
of every eval dataset (`EvalSettings.from_slices`: the eval code never sees the whole Config), and the loading
of those datasets with the reward that scores each. Used by both places that evaluate: the rollout engines
(`coordinator.eval.rollout_engines`, slime's default) and a dedicated eval fleet (`coordinator.eval.fleet`).

Resolution of each value (slime's order): the dataset's entry in `--eval-config` (its `defaults` included) >
the eval flag (`--n-samples-per-eval-prompt`, `--eval-temperature`, `--eval-top-p`, `--eval-top-k`,
`--eval-max-response-len`, `--eval-input-key`, `--eval-label-key`, `--eval-reward-key`) > the rollout flag.

Invariants: every dataset has a reward that can score it (`EvalDatasetSettings.check`: a reward type or
custom rm, a `--eval-reward-key`/`--reward-key` for a dict-valued type, `--rm-url` for `remote_rm`, IFBench
for `ifbench`, Math-Verify for `math_verify`), else a ValueError naming the dataset and the flag to give; a `builtin:<task>` dataset is the
same 32 prompts for one `--rollout-seed` and is scored by its task's rm type unless the dataset names one; a
dataset's `rm_type` is also written into each record's metadata (slime's rule: it wins over a row's own).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from coordinator.data.lines import DEFAULT_MAX_LINE_BYTES
from coordinator.data.source import PromptDataSource, PromptRecord
from coordinator.data.tasks import builtin_task_name, make_task_prompts
from coordinator.rewards.rules import REMOTE_RM, base_rule, require_libraries
from coordinator.rollout.reward_choice import RewardChoice
from coordinator.rollout.rewards import RewardModel

if TYPE_CHECKING:
    from coordinator.config import EvalConfig, RolloutConfig, SglangConfig
    from coordinator.config.eval_file import EvalDatasetSpec

BUILTIN_EVAL_PROMPTS = 32
#: Base sampling seed of eval requests: a sample's seed depends on the evaluation, prompt and sample only.
EVAL_SEED = 0


def _first(*values: Any) -> Any:
    return next((value for value in values if value is not None), None)


@dataclass(frozen=True)
class EvalDatasetSettings:
    """One eval dataset with every value resolved (see the module docstring for the order)."""

    name: str
    path: str
    n_samples: int
    sampling_params: dict[str, Any]  # temperature, top_p, top_k, and stop / penalties when set
    max_response_len: int
    reward: RewardChoice
    input_key: str = "prompt"
    label_key: str | None = None
    metadata_key: str | None = None
    tool_key: str | None = None  # --eval-tool-key, else --tool-key
    apply_chat_template: bool = False
    metadata: dict[str, Any] = field(default_factory=dict)  # merged into every record's metadata
    max_line_bytes: int = DEFAULT_MAX_LINE_BYTES  # --data-max-line-bytes
    #: slime's eval default: the run's --multimodal-keys (images of the eval data decoded and sent too)
    multimodal_keys: dict[str, str] | None = None
    #: the model whose processor expands the images' placeholders (--hf-checkpoint), with multimodal keys
    processor_path: str | None = None

    @property
    def reward_key(self) -> str | None:
        return self.reward.reward_key

    def check(self) -> None:
        """ValueError when this dataset's reward cannot score it (start-up checks call this)."""
        where = f"eval dataset {self.name!r}"
        reward = self.reward
        if reward.rm_type is None and reward.custom_rm_path is None:
            raise ValueError(f"{where} ({self.path}): no reward to score it; give --rm-type or --custom-rm-path, "
                             "or rm_type / custom_rm_path in --eval-config")
        if reward.custom_rm_path is not None or reward.rm_type is None:
            return
        rule, _ = base_rule(reward.rm_type)
        if rule.returns_dict and reward.reward_key is None:
            raise ValueError(f"{where}: rm_type {reward.rm_type} returns a dict reward (score, acc): pass "
                             "--eval-reward-key (or --reward-key) score")
        if rule.name == REMOTE_RM and reward.rm_url is None:
            raise ValueError(f"{where}: rm_type remote_rm needs --rm-url")
        require_libraries(reward.rm_type)  # RewardError (a ValueError) saying what to install

    @classmethod
    def resolve(cls, spec: EvalDatasetSpec, evaluation: EvalConfig, rollout: RolloutConfig) -> EvalDatasetSettings:
        sampling: dict[str, Any] = {
            "temperature": _first(spec.temperature, evaluation.eval_temperature, rollout.rollout_temperature),
            "top_p": _first(spec.top_p, evaluation.eval_top_p, rollout.rollout_top_p),
            "top_k": _first(spec.top_k, evaluation.eval_top_k, rollout.rollout_top_k),
        }
        stop = _first(spec.stop, rollout.rollout_stop)
        stop_token_ids = _first(spec.stop_token_ids, rollout.rollout_stop_token_ids)
        for key, value in (("stop", list(stop)), ("stop_token_ids", list(stop_token_ids)),
                           ("min_new_tokens", spec.min_new_tokens), ("repetition_penalty", spec.repetition_penalty)):
            if value:
                sampling[key] = value
        reward_key = _first(evaluation.eval_reward_key, rollout.reward_key)
        metadata = spec.overrides
        if spec.custom_rm_path is not None:
            reward = RewardChoice(custom_rm_path=spec.custom_rm_path, reward_key=reward_key)
        elif spec.rm_type is not None:
            reward = RewardChoice(rm_type=spec.rm_type, reward_key=reward_key, rm_url=rollout.rm_url)
            metadata["rm_type"] = spec.rm_type
        elif builtin_task_name(spec.path) is not None:
            # a built-in task is scored by its own rm type, whatever the run's reward flags say
            reward = RewardChoice(reward_key=reward_key).resolved(spec.path)
        else:
            run = RewardChoice.from_rollout(rollout).resolved(rollout.prompt_data)
            reward = RewardChoice(rm_type=run.rm_type, custom_rm_path=run.custom_rm_path, group_rm=run.group_rm,
                                  reward_key=reward_key, rm_url=run.rm_url)
        return cls(
            name=spec.name,
            path=spec.path,
            n_samples=_first(spec.n_samples_per_eval_prompt, evaluation.n_samples_per_eval_prompt),
            sampling_params=sampling,
            max_response_len=_first(spec.max_response_len, evaluation.eval_max_response_len,
                                    rollout.rollout_max_response_len),
            reward=reward,
            input_key=_first(spec.input_key, evaluation.eval_input_key, rollout.input_key),
            label_key=_first(spec.label_key, evaluation.eval_label_key, rollout.label_key),
            metadata_key=_first(spec.metadata_key, rollout.metadata_key),
            tool_key=_first(evaluation.eval_tool_key, rollout.tool_key),
            apply_chat_template=_first(spec.apply_chat_template, rollout.apply_chat_template),
            metadata=metadata,
            max_line_bytes=rollout.data_max_line_bytes,
            multimodal_keys=rollout.multimodal_key_map,
            processor_path=rollout.hf_checkpoint,
        )


@dataclass(frozen=True)
class EvalSettings:
    """The flags evaluation reads; `from_slices` is the one place they are taken from the run's config."""

    interval: int | None
    datasets: tuple[EvalDatasetSettings, ...]
    max_in_flight: int
    server_concurrency: int  # --sglang-server-concurrency: requests in flight per engine
    hf_checkpoint: str  # pinned as version "0" when there is no training to export weights
    builtin_prompt_seed: int  # builtin:<task> eval prompts are drawn with --rollout-seed + 1
    allow_partial_fleet: bool = False  # --eval-allow-partial-fleet
    skip_before_train: bool = False  # --skip-eval-before-train
    hf_dir: str | None = None  # --eval-hf-dir: the fleet's snapshots go to <hf_dir>/step_<rollout_id>
    keep_snapshots: int = 2  # --eval-keep-snapshots
    overflow_policy: str = "backpressure"  # --eval-overflow-policy
    num_rollout: int | None = None  # the fleet also evaluates the last rollout (miles' should_run_periodic_action)
    max_context_len: int | None = None  # --eval-max-context-len, else --rollout-max-context-len
    save_hf: str | None = None  # --save-hf: without --eval-hf-dir, the fleet pins those checkpoints (miles)

    @classmethod
    def from_slices(cls, evaluation: EvalConfig, *, rollout: RolloutConfig, sglang: SglangConfig,
                    save_hf: str | None = None) -> EvalSettings:
        """The eval slice's flags and datasets; unset values fall back to the rollout's."""
        return cls(
            interval=evaluation.eval_interval,
            datasets=tuple(EvalDatasetSettings.resolve(spec, evaluation, rollout)
                           for spec in evaluation.dataset_specs),
            max_in_flight=evaluation.eval_max_in_flight,
            server_concurrency=sglang.sglang_server_concurrency,
            hf_checkpoint=str(rollout.hf_checkpoint),
            builtin_prompt_seed=rollout.rollout_seed + 1,
            allow_partial_fleet=evaluation.eval_allow_partial_fleet,
            skip_before_train=evaluation.skip_eval_before_train,
            hf_dir=evaluation.eval_hf_dir,
            keep_snapshots=evaluation.eval_keep_snapshots,
            overflow_policy=evaluation.eval_overflow_policy,
            num_rollout=rollout.num_rollout,
            max_context_len=_first(evaluation.eval_max_context_len, rollout.rollout_max_context_len),
            save_hf=save_hf,
        )


@dataclass
class EvalDataset:
    name: str
    records: list[PromptRecord]
    reward_model: RewardModel
    settings: EvalDatasetSettings


def _records(dataset: EvalDatasetSettings, *, seed: int, tokenizer: Any, raw_prompts: bool = False
             ) -> list[PromptRecord]:
    """Every record of the dataset in file order, chat template applied when asked, metadata merged.
    `raw_prompts`: a prompt may be any JSON value (a custom generate function reads it)."""
    task = builtin_task_name(dataset.path)
    if task is not None:
        source = PromptDataSource.from_records(
            make_task_prompts(task, BUILTIN_EVAL_PROMPTS, seed), apply_chat_template=dataset.apply_chat_template,
            tokenizer=tokenizer, shuffle=False, seed=seed, source=dataset.path)
    else:
        source = PromptDataSource(dataset.path, input_key=dataset.input_key, label_key=dataset.label_key,
                                  metadata_key=dataset.metadata_key, apply_chat_template=dataset.apply_chat_template,
                                  tokenizer=tokenizer, shuffle=False, seed=seed, raw_prompts=raw_prompts,
                                  max_line_bytes=dataset.max_line_bytes, tool_key=dataset.tool_key,
                                  multimodal_keys=dataset.multimodal_keys)
    records = source.take(len(source))
    for record in records:
        if not isinstance(record.prompt, str) and not raw_prompts:
            raise ValueError(f"eval dataset {dataset.name!r} ({dataset.path}) holds chat messages but no chat "
                             "template is applied; set --apply-chat-template (or apply_chat_template in "
                             "--eval-config)")
        record.metadata.update(dataset.metadata)
    return records


def load_eval_datasets(settings: EvalSettings, tokenizer: Any = None, *, hook_args: Any = None,
                       raw_prompts: bool = False) -> list[EvalDataset]:
    """Every eval dataset: its records (a `builtin:<task>`: 32 prompts drawn with seed + 1) and reward
    (`hook_args`: what a slime-style custom rm gets first; `raw_prompts`: prompts of any JSON value, for a
    custom generate function)."""
    datasets = []
    for dataset in settings.datasets:
        dataset.check()
        reward_model = dataset.reward.model(args=hook_args)
        assert reward_model is not None  # check() refuses a dataset without a reward
        records = _records(dataset, seed=settings.builtin_prompt_seed, tokenizer=tokenizer, raw_prompts=raw_prompts)
        datasets.append(EvalDataset(name=dataset.name, records=records, reward_model=reward_model,
                                    settings=dataset))
    return datasets
