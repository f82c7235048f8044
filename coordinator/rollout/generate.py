"""The generate path: the default rollout function.

Owns turning prompt records into scored, filtered groups of samples through the dispatcher:
`n_samples_per_prompt` requests per prompt on one engine (`requests.generate_group`, or a custom generate
function through `hook_generate`), within the GenerateState request slots; groups scored, filtered and
accepted until `rollout_batch_size` groups are in; then every straggler aborted at once (kept for the next
rollout with `--partial-rollout`). The path step by step: docs/rollout.md.

Invariants:
- a rollout returns exactly `rollout_batch_size` groups of exactly `n_samples_per_prompt` samples each (a
  custom generate function that returns several samples for one makes its group larger);
- every accepted sample was answered exactly once (the dispatcher retries only requests whose engine died);
- at most `generate concurrency` requests are in flight (the request slots), never an unbounded number.
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import anyio
from anyio.streams.memory import MemoryObjectSendStream

from coordinator.data.source import PromptRecord
from coordinator.observe.progress import ENGINE_RATE_PREFIX
from coordinator.observe.timeline import span
from coordinator.rewards.pass_rate import pass_rates
from coordinator.rollout.dispatch import Dispatcher, EnginePool
from coordinator.rollout.filters import DynamicFilter
from coordinator.rollout.hook_generate import CustomGenerate
from coordinator.rollout.requests import GenerateState, generate_group, new_sample, with_images
from coordinator.rollout.reward_post import reward_category_metrics
from coordinator.rollout.rewards import RewardModel
from replay.sample import RolloutBatch, Sample, SampleStatus
from workers.protocol.control import pack_sample_ahead

if TYPE_CHECKING:
    from coordinator.rollout.context import RolloutContext

log = logging.getLogger(__name__)

__all__ = ["DefaultRollout", "GenerateState", "PartialGroup", "RolloutProgress"]  # GenerateState: re-exported


@dataclass
class PartialGroup:
    """Aborted stragglers of an earlier rollout, continued in the next one (`--partial-rollout`)."""

    record: PromptRecord
    prompt_ids: list[int]
    samples: list[Sample]


@dataclass
class RolloutProgress:
    target: int
    accepted: int = 0
    in_flight: int = 0
    generated_tokens: int = 0
    #: generated tokens by the engine URL that returned them (a router's URL through sglang-router): each
    #: engine's share of `generated_tokens`, the one source of its tokens/s (metrics, status page, /metrics)
    tokens_by_engine: Counter[str] = field(default_factory=Counter)
    aborted: int = 0
    filtered: int = 0
    started: float = field(default_factory=time.monotonic)

    def line(self) -> str:
        elapsed = max(time.monotonic() - self.started, 1e-9)
        return (
            f"groups {self.accepted}/{self.target}  in flight {self.in_flight}  "
            f"{self.generated_tokens / elapsed:,.0f} tok/s  aborted {self.aborted}  filtered {self.filtered}"
        )


class DefaultRollout:
    """The default rollout fn: constructed once with the context, called once per rollout."""

    def __init__(self, context: RolloutContext) -> None:
        # Pieces are read from the context when used, not here: in --debug-train-only the fn is built but the
        # engines are not, and using it then must fail with the context's clear "not built" error.
        self.context = context
        self.settings = context.config.rollout  # this fn reads the rollout slice only
        self.partial_buffer: list[PartialGroup] = []
        self.progress: RolloutProgress | None = None

    @property
    def state(self) -> GenerateState:
        return self.context.generate_state

    @property
    def dispatcher(self) -> Dispatcher:
        return self.context.dispatcher

    @property
    def data_source(self) -> Any:
        return self.context.data_source

    @property
    def reward_model(self) -> RewardModel:
        return self.context.reward_model

    @property
    def filter(self) -> DynamicFilter | None:
        return self.context.dynamic_filter

    @property
    def custom_generate(self) -> CustomGenerate | None:
        return self.context.custom_generate

    async def __call__(self, rollout_id: int, weight_version: str) -> RolloutBatch:
        settings = self.settings
        # Reach every piece up front: in a mode that did not build one, fail here with its clear error.
        _ = self.state, self.dispatcher, self.data_source, self.reward_model
        target = settings.rollout_batch_size
        assert target is not None
        progress = self.progress = RolloutProgress(target=target)
        if self.filter is not None:
            self.filter.reset()
        started = time.monotonic()
        accepted: list[list[Sample]] = []
        stragglers: list[PartialGroup] = []
        send, receive = anyio.create_memory_object_stream[tuple[PartialGroup, list[Sample]]](
            max_buffer_size=settings.effective_over_sampling_batch_size
        )
        next_group_index = 0
        pending = 0

        async def run_group(group: PartialGroup,
                            stream: MemoryObjectSendStream[tuple[PartialGroup, list[Sample]]]) -> None:
            async with stream:
                samples = await self._generate_group(group, rollout_id)
                await stream.send((group, samples))

        with self.context.progress_display(f"rollout {rollout_id}", progress) as refresh:
            async with send, receive, anyio.create_task_group() as task_group:

                def submit(groups: list[PartialGroup]) -> None:
                    nonlocal pending
                    for group in groups:
                        pending += 1
                        task_group.start_soon(run_group, group, send.clone())

                resumed = self._take_partial_buffer()
                first = resumed + self._new_groups(
                    settings.effective_over_sampling_batch_size - len(resumed), len(resumed)
                )
                next_group_index += len(first)
                submit(first)
                async for group, samples in receive:
                    pending -= 1
                    aborted = [s for s in samples if s.status is SampleStatus.ABORTED]
                    if aborted:
                        # Aborted before the batch was full (an engine paused with mode=abort): generate the
                        # aborted samples again, so the prompt is not lost.
                        progress.aborted += len(aborted)
                        submit([self._resume(PartialGroup(group.record, group.prompt_ids, samples))])
                    elif len(accepted) < target and await self._keep(samples, progress):
                        accepted.append(samples)
                        for sample in samples:  # packed for the ranks now, while other groups generate
                            pack_sample_ahead(sample)
                        progress.accepted = len(accepted)
                    if len(accepted) >= target:
                        break
                    if pending + len(accepted) < target:
                        more = self._new_groups(settings.effective_over_sampling_batch_size, next_group_index)
                        next_group_index += len(more)
                        submit(more)
                    refresh()
                # The batch is full: abort every straggler at once, collect what they return.
                if pending:
                    await self.dispatcher.abort_all()
                    if self.custom_generate is not None:  # miles: the agent's own abort(args), if it has one
                        from coordinator.rollout.agent_abort import call_agent_abort_hook

                        await call_agent_abort_hook(self.custom_generate.runtime.args)
                    with anyio.move_on_after(10):
                        while pending:
                            group, samples = await receive.receive()
                            pending -= 1
                            progress.aborted += sum(s.status is SampleStatus.ABORTED for s in samples)
                            stragglers.append(PartialGroup(group.record, group.prompt_ids, samples))
                    task_group.cancel_scope.cancel()
                refresh()

        if settings.partial_rollout:
            self.partial_buffer = [self._resume(group) for group in stragglers]
        _in_submission_order(accepted)
        metrics = self._metrics(accepted, progress, time.monotonic() - started)
        sessions = getattr(self.custom_generate.runtime, "sessions", None) if self.custom_generate else None
        if sessions is not None:  # the session server's sessions a generate function left open
            metrics["rollout/sessions_reaped"] = float(await sessions.reap(started))
        return RolloutBatch(rollout_id=rollout_id, groups=accepted, metrics=metrics)

    # ------------------------------------------------------------------------------------------------------
    def _take_partial_buffer(self) -> list[PartialGroup]:
        """The groups continued from the last rollout; they go first in submission order."""
        resumed, self.partial_buffer = self.partial_buffer, []
        for index, group in enumerate(resumed):
            for sample in group.samples:
                sample.group_index = index
        return resumed

    async def _keep(self, samples: list[Sample], progress: RolloutProgress) -> bool:
        """Score a finished group; False when the dynamic filter drops it."""
        with span("reward", ("rollout", None)):
            await self.reward_model.score_group(samples, keep_given=self.custom_generate is not None)
        if self.filter is None:
            return True
        with span("filter", ("rollout", None)):
            keep = (await self.filter(samples)).keep
        if not keep:
            progress.filtered += 1
        return keep

    def _new_groups(self, count: int, first_index: int) -> list[PartialGroup]:
        if count <= 0:
            return []
        groups = []
        n = self.settings.n_samples_per_prompt
        records = list(self.data_source.take(count))
        if self.custom_generate is not None:  # the function tokenizes the prompt (any value) itself, as slime's
            encoded: list[list[int]] = [[] for _ in records]
        else:
            prompts: list[str] = []
            for record in records:
                if not isinstance(record.prompt, str):
                    raise TypeError(
                        "prompt records hold chat messages but --apply-chat-template is not set; set it, or give "
                        "plain-text prompts"
                    )
                prompts.append(record.prompt)
            encoded = self.state.encode_many(prompts)  # one tokenizer call for every new group
        for offset, (record, prompt_ids) in enumerate(zip(records, encoded, strict=True)):
            prompt_ids, train_inputs = with_images(self.state, record, prompt_ids,
                                                   hook=self.custom_generate is not None)
            samples = [new_sample(record, prompt_ids, first_index + offset, k, n_samples=n) for k in range(n)]
            for sample in samples:
                sample.multimodal_train_inputs = train_inputs
            groups.append(PartialGroup(record, prompt_ids, samples))
        return groups

    def _resume(self, group: PartialGroup) -> PartialGroup:
        """Make aborted samples generate again: anew, or with --partial-rollout from where they stopped (our
        request code continues the tokens; a custom generate function gets the sample as it stands)."""
        for sample in group.samples:
            if sample.status is not SampleStatus.ABORTED:
                continue
            sample.reward = None
            if self.settings.partial_rollout and self.custom_generate is not None:
                continue  # still ABORTED: the function sees what happened and decides (slime's contract)
            if self.settings.partial_rollout and sample.is_multi_turn:
                raise RuntimeError(f"sample {sample.group_index}/{sample.sample_index} holds tool output (loss "
                                   "mask 0) but no custom generate function continues it; rayless appends only "
                                   "to single-turn samples")
            sample.status = SampleStatus.PENDING
            if not self.settings.partial_rollout:
                sample.tokens = sample.tokens[: sample.prompt_length]
                sample.response_length = 0
                sample.loss_mask, sample.rollout_log_probs, sample.weight_versions = [], [], []
                sample.response = ""
                if self.custom_generate is not None and group.record.images:
                    # a later turn's images went with the response: the function starts again from the prompt's
                    sample.multimodal_inputs = {"images": list(group.record.images)}
                    sample.multimodal_train_inputs = None
        return group

    async def _generate_group(self, group: PartialGroup, rollout_id: int) -> list[Sample]:
        """Generate the unfinished samples of one group on one engine (`requests.generate_group`, or the
        custom generate function)."""
        if self.custom_generate is not None:
            runtime = self.custom_generate.runtime
            group.samples = await self.custom_generate.generate_group(
                group.samples, rollout_id, state=self.state,
                sampling_params=runtime.generate_state.sampling_params, progress=self.progress)
            return group.samples
        return await generate_group(self.state, self.dispatcher, group.samples, rollout_id,
                                    progress=self.progress)

    def _metrics(
        self, groups: list[list[Sample]], progress: RolloutProgress, seconds: float
    ) -> dict[str, float]:
        samples = [sample for group in groups for sample in group]
        rewards = [sample.scalar_reward(self.settings.reward_key) for sample in samples]
        lengths = [sample.response_length for sample in samples]
        mean = sum(rewards) / max(len(rewards), 1)
        std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / max(len(rewards), 1))
        metrics = {
            "rollout/reward_mean": mean,
            "rollout/reward_std": std,
            "rollout/response_len_mean": sum(lengths) / max(len(lengths), 1),
            "rollout/truncated_ratio": sum(s.status is SampleStatus.TRUNCATED for s in samples)
            / max(len(samples), 1),
            "rollout/aborted_stragglers": float(progress.aborted),
            # samples whose reward function escaped (exit, interrupt, its own cancellation): reward 0.0
            "rollout/failed_samples": float(sum(s.status is SampleStatus.FAILED for s in samples)),
            "rollout/filtered_groups": float(progress.filtered),
            "rollout/engine_retries": float(self.dispatcher.retried),
            "rollout/refused_replies": float(self.dispatcher.refused_total),
            "rollout/time_s": seconds,
            "rollout/tokens_per_s": progress.generated_tokens / max(seconds, 1e-9),
            "rollout/partial_buffer": float(len(self.partial_buffer)),
            **engine_rates(progress.tokens_by_engine, self.dispatcher.pool, seconds),
        }
        if self.filter is not None:
            metrics.update(self.filter.metrics())
        if self.context.config.hooks.log_multi_turn:
            metrics.update(multi_turn_metrics(samples, self.settings.rollout_max_response_len))
        if self.context.config.rollout.log_reward_category is not None:
            metrics.update(reward_category_metrics(samples, self.context.config.rollout.log_reward_category))
        if self.context.config.logging.log_passrate:
            rewards_by_group = [[s.scalar_reward(self.settings.reward_key) for s in group] for group in groups]
            metrics.update({f"passrate/pass@{k}": rate for k, rate in pass_rates(rewards_by_group).items()})
        return metrics


def model_turns(sample: Sample) -> int:
    """The model's turns in a sample: its runs of loss-mask-1 response tokens (tool output separates them)."""
    mask = sample.loss_mask
    return sum(1 for i, value in enumerate(mask) if value and (i == 0 or not mask[i - 1]))


def engine_rates(tokens_by_engine: Counter[str], pool: EnginePool, seconds: float) -> dict[str, float]:
    """`rollout/tokens_per_s/<engine>`: each engine's generated tokens of this rollout over the rollout's
    seconds, so the engines' rates add up to `rollout/tokens_per_s` (what the terminal's rollout line
    shows). An engine is named as the fleet names it; tokens from a URL that is no engine of the fleet (the
    router's) have no per-engine figure."""
    names = {handle.url: handle.name for handle in getattr(pool, "engines", ())}
    return {ENGINE_RATE_PREFIX + names[url]: tokens / max(seconds, 1e-9)
            for url, tokens in sorted(tokens_by_engine.items()) if url in names}


def multi_turn_metrics(samples: list[Sample], max_response_len: int) -> dict[str, float]:
    """slime's `--log-multi-turn` metrics: response lengths with tool output (raw) and without (the loss
    mask's sum), and the model's turns per sample (`round_number`)."""
    if not samples:
        return {}
    raw = [float(sample.response_length) for sample in samples]
    trained = [float(sum(sample.loss_mask)) for sample in samples]
    turns = [float(model_turns(sample)) for sample in samples]
    metrics = {"multi_turn/raw_response_length/response_length_clip_ratio":
               sum(length >= max_response_len for length in raw) / len(raw)}
    for name, values in (("raw_response_length/response_length", raw),
                         ("wo_obs_response_length/response_length", trained),
                         ("multi_turn_metric/round_number", turns)):
        metrics[f"multi_turn/{name}_mean"] = sum(values) / len(values)
        metrics[f"multi_turn/{name}_max"] = max(values)
        metrics[f"multi_turn/{name}_min"] = min(values)
    return metrics


def _in_submission_order(groups: list[list[Sample]]) -> None:
    """Groups finish in an order set by timing; hand them over in submission order (renumbered) so a rerun
    (or a resumed run) with the same data and seeds yields the same batch."""
    groups.sort(key=lambda group: group[0].group_index)
    index = 0
    for new_index, group in enumerate(groups):
        for sample in group:
            sample.group_index = new_index
            sample.index = index  # slime's: the sample's position in the rollout
            index += 1
