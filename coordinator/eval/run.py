"""One evaluation of one dataset: generate, score, and the metrics slime logs for it.

Owns the part both evaluators share (the rollout engines' `coordinator.eval.rollout_engines` and the dedicated
`coordinator.eval.fleet`): each prompt sampled `n_samples` times through the generate path's own request code
(`requests.generate_group`: one group per engine, the eval id in place of the rollout id in the seeds) — or, on
the rollout engines, through `--custom-generate-function-path` with `evaluation=True`, as slime — each group
scored by the dataset's reward, and the dataset's metrics.

Metric names, for a dataset `<name>` (slime's where slime has one):
- `eval/<name>`: mean reward (the scalar, or the `--eval-reward-key` entry); also `eval/<name>/reward_mean`;
- `eval/<name>-pass@k` for k = 1, 2, 4, ... up to the largest group (`coordinator.rewards.pass_rate`, slime's
  estimator: a sample with reward ≥ 1 is correct); `eval/<name>/pass_at_k`: prompts with at least
  one correct sample (= pass@n);
- `eval/<name>/truncated_ratio` and `eval/<name>-truncated_ratio` (slime logs both): samples cut by the length
  limit;
- `eval/<name>/response_len/{mean,median,max,min}`: response tokens;
- `eval/<name>/samples`, `eval/<name>/aborted` (samples still aborted after the restarts: scored 0),
  `eval/<name>/generate_s`.
"""

from __future__ import annotations

import statistics
import time
from typing import TYPE_CHECKING

import anyio

from coordinator.data.tasks import is_image_task
from coordinator.eval.settings import EVAL_SEED, EvalDataset
from coordinator.rewards.pass_rate import pass_rates
from coordinator.rollout.dispatch import Dispatcher
from coordinator.rollout.requests import GenerateState, RequestSlots, generate_group, new_sample, with_images
from replay.sample import Sample, SampleStatus

if TYPE_CHECKING:
    from coordinator.rollout.hook_generate import CustomGenerate

MAX_ABORT_RESTARTS = 8


def generate_state(dataset: EvalDataset, *, tokenizer: object, context_length: int, concurrency: int,
                   request_slots: RequestSlots | None = None) -> GenerateState:
    """The GenerateState of one dataset: its sampling params and response budget; `request_slots` shares
    the bound on requests in flight with the rollout (eval on the rollout engines)."""
    settings = dataset.settings
    vision = None
    # images come from the records' columns (`--multimodal-keys`) or from a built-in image task (`builtin:colour`,
    # whose prompts hold their images whatever the flags say), as the rollout's processor is chosen
    if settings.processor_path is not None and (settings.multimodal_keys or is_image_task(settings.path)):
        from workers.vlm_processor import VlmProcessor

        vision = VlmProcessor(settings.processor_path)
    return GenerateState(tokenizer=tokenizer, sampling_params=dict(settings.sampling_params),
                         max_response_len=settings.max_response_len, context_length=context_length,
                         concurrency=concurrency, seed=EVAL_SEED, request_slots=request_slots, vision=vision)


def _restart(sample: Sample) -> None:
    """An aborted sample generates again from its prompt (its partial tokens are dropped); counted in its
    metadata (`eval_restarts`)."""
    sample.metadata["eval_restarts"] = sample.metadata.get("eval_restarts", 0) + 1
    sample.tokens = sample.tokens[: sample.prompt_length]
    sample.response_length = 0
    sample.loss_mask, sample.rollout_log_probs, sample.weight_versions = [], [], []
    sample.response = ""
    sample.status = SampleStatus.PENDING
    sample.reward = None


def hook_params(state: GenerateState) -> dict[str, object]:
    """A dataset's sampling params as a custom generate function gets them (slime's eval params)."""
    return {"skip_special_tokens": False, "no_stop_trim": True, "spaces_between_special_tokens": False,
            **state.sampling_params, "max_new_tokens": state.max_response_len}


async def generate_and_score(dataset: EvalDataset, state: GenerateState, dispatcher: Dispatcher,
                             eval_id: int, *, custom: CustomGenerate | None = None) -> list[list[Sample]]:
    """Every prompt of `dataset` sampled `n_samples` times and scored; groups in prompt order.

    A sample aborted by the engine (on the rollout engines, with `--async-rollout`, the rollout being
    generated meanwhile aborts every straggler once its batch is full) is generated again, up to
    `MAX_ABORT_RESTARTS` times; one still aborted then is scored 0 and counted in `eval/<name>/aborted`.
    """
    groups = []
    n = dataset.settings.n_samples
    for index, record in enumerate(dataset.records):
        prompt_ids = [] if custom is not None else state.encode(str(record.prompt))
        prompt_ids, train_inputs = with_images(state, record, prompt_ids, hook=custom is not None)
        samples = [new_sample(record, prompt_ids, index, k, n_samples=n) for k in range(n)]
        for sample in samples:
            sample.multimodal_train_inputs = train_inputs
        groups.append(samples)

    async def run_group(samples: list[Sample]) -> None:
        for attempt in range(MAX_ABORT_RESTARTS + 1):
            if custom is not None:
                samples[:] = await custom.generate_group(samples, eval_id, state=state,
                                                         sampling_params=hook_params(state), evaluation=True)
            else:
                await generate_group(state, dispatcher, samples, eval_id, logprobs=False)
            aborted = [sample for sample in samples if sample.status is SampleStatus.ABORTED]
            if not aborted or attempt == MAX_ABORT_RESTARTS:
                break
            for sample in aborted:
                _restart(sample)
        await dataset.reward_model.score_group(samples, keep_given=custom is not None)

    async with anyio.create_task_group() as task_group:
        for samples in groups:
            task_group.start_soon(run_group, samples)
    return groups


def dataset_metrics(name: str, groups: list[list[Sample]], reward_key: str | None,
                    seconds: float) -> dict[str, float]:
    """The metrics of one evaluated dataset (names in the module docstring)."""
    samples = [sample for group in groups for sample in group]
    count = max(len(samples), 1)
    rewards = [sample.scalar_reward(reward_key) for sample in samples]
    lengths = [sample.response_length for sample in samples] or [0]
    mean = sum(rewards) / count
    truncated = sum(sample.status is SampleStatus.TRUNCATED for sample in samples) / count
    correct = [sum(sample.scalar_reward(reward_key) >= 1.0 for sample in group) for group in groups]
    prefix = f"eval/{name}"
    metrics = {
        prefix: mean,
        f"{prefix}/reward_mean": mean,
        f"{prefix}/pass_at_k": sum(c > 0 for c in correct) / max(len(groups), 1),
        f"{prefix}/truncated_ratio": truncated,
        f"{prefix}-truncated_ratio": truncated,
        f"{prefix}/response_len/mean": sum(lengths) / len(lengths),
        f"{prefix}/response_len/median": float(statistics.median(lengths)),
        f"{prefix}/response_len/max": float(max(lengths)),
        f"{prefix}/response_len/min": float(min(lengths)),
        f"{prefix}/samples": float(len(samples)),
        f"{prefix}/aborted": float(sum(sample.status is SampleStatus.ABORTED for sample in samples)),
        f"{prefix}/generate_s": seconds,
    }
    for k, rate in pass_rates([[s.scalar_reward(reward_key) for s in group] for group in groups]).items():
        metrics[f"{prefix}-pass@{k}"] = rate
    return metrics


async def evaluate_dataset(dataset: EvalDataset, state: GenerateState, dispatcher: Dispatcher,
                           eval_id: int, *, custom: CustomGenerate | None = None
                           ) -> tuple[list[list[Sample]], dict[str, float]]:
    """Generate, score and measure one dataset: (the groups, their metrics)."""
    started = time.monotonic()
    groups = await generate_and_score(dataset, state, dispatcher, eval_id, custom=custom)
    return groups, dataset_metrics(dataset.name, groups, dataset.settings.reward_key, time.monotonic() - started)
