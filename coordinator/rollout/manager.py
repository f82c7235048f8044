"""RolloutManager: builds exactly the rollout machinery the run's mode needs, and nothing else.

Owns the construction gates of the mode table (docs/architecture.md), reading only `Config`'s derived facts:

| mode                            | rollout fn | eval fn | GenerateState / dispatcher | replay loader |
|---------------------------------|------------|---------|----------------------------|---------------|
| replay (--load-debug-rollout-data) | no      | no      | no                         | yes           |
| --debug-train-only              | yes        | yes     | no                         | no            |
| otherwise                       | yes        | yes (shared when the paths are equal) | yes          | no            |

Hooks in slime's form get the run's `HookRuntime` (their `args`, slime's `GenerateState`, the address they post
to), built here once; `--custom-generate-function-path` is loaded here and used by the default rollout fn.

Invariant: a piece that this mode did not build is never `None`-called: reaching it raises `NotBuiltError`,
which names the mode and the flag that turned it off. Every batch handed to the training loop has its
advantages computed here (one place, for generated and replayed rollouts alike) and, with
`--save-debug-rollout-data`, is dumped before it is returned.

`workers.collector.tune_collector` is what a run calls once its pieces are built: the heap that start-up made
(transformers, the tokenizer, the config) lives as long as the run, and moving it out of the collector's reach,
with fewer passes over each rollout's own objects, keeps the collector's share of a sample small and flat in the
rollout's size (issue 38: it was half the generate path's CPU per sample).
"""

from __future__ import annotations

import argparse
import inspect
import logging
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import anyio

from coordinator.config import DEFAULT_ROLLOUT_FUNCTION, Config, RolloutConfig
from coordinator.config.distill import teacher_hook
from coordinator.data.source import PromptDataSource
from coordinator.hooks.args import build_hook_args, hook_sampling_params
from coordinator.hooks.forms import HookForm, read_rollout_class, read_rollout_fn
from coordinator.hooks.runtime import HookRuntime
from coordinator.observe.progress import ProgressDisplay
from coordinator.rollout.advantages import compute_advantages
from coordinator.rollout.chat_kwargs import with_chat_template_kwargs
from coordinator.rollout.context import NotBuiltError, RolloutContext, not_built
from coordinator.rollout.dispatch import Dispatcher, EnginePool
from coordinator.rollout.filters import DynamicFilter
from coordinator.rollout.hook_generate import CustomGenerate
from coordinator.rollout.requests import GenerateState
from coordinator.rollout.reward_choice import RewardChoice
from coordinator.rollout.reward_post import RewardPostProcess
from coordinator.rollout.rewards import RewardModel
from coordinator.rollout.teacher import TeacherScorer, require_teacher_log_probs, settle_teacher_log_probs
from replay.sample import RolloutBatch
from workers.boundary.json_input import JsonObject
from workers.hook_loading import load_object

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from coordinator.engines.client import EngineClient
    from replay.loader import ReplayLoader
    from workers.vlm_processor import VlmProcessor

log = logging.getLogger(__name__)


RolloutCallable = Callable[[int, str], Awaitable[RolloutBatch]]


def instantiate_rollout_fn(path: str, context: RolloutContext, *, what: str) -> RolloutCallable:
    """A class is constructed once with the context, or in miles' form with `RolloutFnConstructorInput`
    (`coordinator.rollout.miles_rollout_fn`); a function is called as fn(context, rollout_id, version), or in
    slime's form fn(args, rollout_id, data_source, evaluation=False) (`coordinator.rollout.slime_rollout_fn`)."""
    target = load_object(path, what=what)
    if not inspect.isclass(target) and callable(target) and read_rollout_fn(what, path, target).form is HookForm.SLIME:
        from coordinator.rollout.slime_rollout_fn import SlimeRolloutFn

        return SlimeRolloutFn(target, path=path, context=context, what=what)
    if inspect.isclass(target) and read_rollout_class(what, path, target).form is HookForm.MILES:
        from coordinator.rollout.miles_rollout_fn import MilesRolloutFn

        return MilesRolloutFn(target, path=path, context=context, what=what)
    if inspect.isclass(target):
        instance = target(context)
        if not callable(instance):
            raise TypeError(f"{what} {path!r}: instances of {target.__name__} are not callable")
        return _as_async(instance, path, what)
    if callable(target):
        return _as_async(lambda rollout_id, version: target(context, rollout_id, version), path, what)
    raise TypeError(f"{what} {path!r} is neither a class nor a function")


def _as_async(fn: Callable[[int, str], object], path: str, what: str) -> RolloutCallable:
    async def call(rollout_id: int, weight_version: str) -> RolloutBatch:
        result = fn(rollout_id, weight_version)
        if inspect.isawaitable(result):
            result = await result
        if isinstance(result, RolloutBatch):
            return result
        if isinstance(result, list):
            return RolloutBatch(rollout_id=rollout_id, groups=result)
        raise TypeError(
            f"{what} {path!r} returned {type(result).__name__}; expected a RolloutBatch or a list "
            "of sample groups"
        )

    return call


#: what a RolloutManager constructs, counted by name (rollout_fns, eval_fns: slime-style functions loaded;
#: generate_states, dispatchers: what generation needs, none in replay; replay_loaders, data_sources: where
#: samples come from), so tests pin the gates down instead of assuming them
BUILT_PIECES = ("rollout_fns", "eval_fns", "generate_states", "dispatchers", "replay_loaders", "data_sources")


class RolloutManager:
    def __init__(self, *, config: Config) -> None:
        self.config = config
        self.counts: Counter[str] = Counter(dict.fromkeys(BUILT_PIECES, 0))
        self._rollout_fn: RolloutCallable | None = None
        self._eval_fn: RolloutCallable | None = None
        self._replay_loader: ReplayLoader | None = None
        self.context: RolloutContext | None = None
        #: slime's --custom-reward-post-process-path (not in replay: the dumps are re-scored by the estimator)
        self.reward_post_process: RewardPostProcess | None = None
        #: on-policy distillation's `sglang` teacher: asks teacher logprobs of each generated sample
        self.teacher: TeacherScorer | None = None
        #: the flag of the hook that supplies teacher logprobs itself (`--opd-type sglang` without a teacher)
        self.hook_teacher: str | None = None

    # --- construction -------------------------------------------------------------------------------------
    @classmethod
    def build(
        cls,
        config: Config,
        *,
        tokenizer: PreTrainedTokenizerBase | None = None,
        client: EngineClient | None = None,
        pool: EnginePool | None = None,
        router_url: str | None = None,
        context_length: int | None = None,
        progress: ProgressDisplay | None = None,
        teacher_urls: dict[str, str] | None = None,
    ) -> RolloutManager:
        """The manager of `config`'s mode: the replay loader alone in replay mode; else the generate path (when
        the run has engines), the context a rollout fn is built with, and the rollout and eval fns."""
        manager = cls(config=config)
        tokenizer = with_chat_template_kwargs(tokenizer, config.rollout.chat_template_kwargs)
        if config.replay_mode:
            manager._build_replay_loader()
            return manager
        runtime = HookRuntime(args=build_hook_args(config), api_key=config.sglang.sglang_api_key)
        if config.rollout.custom_reward_post_process_path is not None:
            manager.reward_post_process = RewardPostProcess.load(config.rollout.custom_reward_post_process_path,
                                                                 args=runtime.args)
        generate_state, dispatcher = manager._build_generate_path(
            runtime, tokenizer=tokenizer, client=client, pool=pool, router_url=router_url,
            context_length=context_length,
        )
        manager.context = manager._build_context(runtime, tokenizer=tokenizer, generate_state=generate_state,
                                                 dispatcher=dispatcher, progress=progress)
        manager._build_rollout_fns(manager.context)
        if config.distill.engine_teacher and config.needs_engines:  # the flags' teachers, or the one launched
            routes = {**config.distill.teacher_routes(config.rollout.rm_url, config.rollout.rm_type),
                      **(teacher_urls or {})}
            if routes or teacher_hook(config.rollout, config.hooks) is None:
                manager.teacher = TeacherScorer(client, routes, key=config.distill.opd_teacher_key,
                                                concurrency=config.sglang.sglang_server_concurrency,
                                                top_k=config.distill.top_k, student=manager._student_scorer(dispatcher))
            else:  # slime's contract: the hook asks the teacher and sets sample.teacher_log_probs
                manager.hook_teacher = teacher_hook(config.rollout, config.hooks)
        return manager

    @staticmethod
    def _student_scorer(dispatcher: Dispatcher | None) -> Callable[[dict[str, Any]], Awaitable[Any]] | None:
        """Top-k OPD's scoring request to the policy's own engines (miles' `_student_score_url`)."""
        if dispatcher is None:
            return None

        async def score(payload: dict[str, Any]) -> Any:
            answer, _url = await dispatcher.generate(payload)
            return answer

        return score

    def _build_replay_loader(self) -> None:
        from replay.loader import ReplayLoader

        config = self.config
        self._replay_loader = ReplayLoader(
            config.debug.load_debug_rollout_data,  # type: ignore[arg-type]
            subsample=config.debug.load_debug_rollout_data_subsample,
            seed=config.rollout.rollout_seed,
            n_samples_per_prompt=None,
        )
        self.counts["replay_loaders"] += 1

    def _build_generate_path(
        self, runtime: HookRuntime, *, tokenizer: PreTrainedTokenizerBase, client: EngineClient,
        pool: EnginePool | None, router_url: str | None, context_length: int | None,
    ) -> tuple[GenerateState | None, Dispatcher | None]:
        """The GenerateState and the dispatcher, when the run has engines (else neither); the hooks' runtime
        is given the state's request slots."""
        config, rollout = self.config, self.config.rollout
        if not config.needs_engines:
            return None, None
        if client is None or (pool is None and router_url is None):
            raise ValueError("a run that generates needs an engine client and a fleet or router")
        generate_state = GenerateState(
            tokenizer=tokenizer,
            sampling_params=sampling_params(rollout),
            max_response_len=rollout.rollout_max_response_len,
            context_length=context_length or rollout.rollout_max_context_len or 1 << 30,
            concurrency=config.generate_concurrency,
            seed=rollout.rollout_seed,
            top_logprobs_num=config.distill.student_top_logprobs_num,
            vision=vision_processor(rollout),
        )
        self.counts["generate_states"] += 1
        dispatcher = Dispatcher(client=client, pool=pool, router_url=router_url,
                                watch_engine_state=config.health_monitor_enabled)
        self.counts["dispatchers"] += 1
        assert generate_state.request_slots is not None
        runtime.attach_generate_state(tokenizer=tokenizer, sampling_params=hook_sampling_params(config),
                                      slots=generate_state.request_slots, processor=generate_state.vision)
        return generate_state, dispatcher

    def _build_context(
        self, runtime: HookRuntime, *, tokenizer: PreTrainedTokenizerBase, generate_state: GenerateState | None,
        dispatcher: Dispatcher | None, progress: ProgressDisplay | None,
    ) -> RolloutContext:
        """What a rollout fn is built with: the custom generate fn, the prompt data, the reward and the filter."""
        config, rollout = self.config, self.config.rollout
        custom_generate = None
        if config.hooks.custom_generate_function_path is not None and dispatcher is not None:
            custom_generate = CustomGenerate.load(config.hooks.custom_generate_function_path, runtime=runtime,
                                                  dispatcher=dispatcher)
        data_source = (build_data_source(rollout, tokenizer,
                                         raw_prompts=config.hooks.custom_generate_function_path is not None,
                                         chat_template=not config.sft.enabled,  # SFT templates whole chats
                                         # an agent gets a chat with images as messages (coordinator.sessions)
                                         render_images=config.hooks.custom_agent_function_path is None)
                       if rollout.prompt_data and not rollout.disable_rollout_global_dataset else None)
        if data_source is not None:
            self.counts["data_sources"] += 1
        reward_model = build_reward_model(rollout, args=runtime.args)
        dynamic_filter = (
            DynamicFilter.load(rollout.dynamic_sampling_filter_path, reward_key=rollout.reward_key,
                               args=runtime.args)
            if rollout.dynamic_sampling_filter_path
            else None
        )
        return RolloutContext(
            config=config,
            tokenizer=tokenizer,
            data_source=data_source,
            generate_state=generate_state,
            dispatcher=dispatcher,
            reward_model=reward_model,
            dynamic_filter=dynamic_filter,
            progress_display=progress,
            hook_runtime=runtime,
            custom_generate=custom_generate,
        )

    def _build_rollout_fns(self, context: RolloutContext) -> None:
        """The rollout fn, and the eval fn: the same instance when the two paths are equal."""
        rollout = self.config.rollout
        self._rollout_fn = instantiate_rollout_fn(
            rollout.rollout_function_path, context, what="--rollout-function-path"
        )
        self.counts["rollout_fns"] += 1
        if rollout.shares_rollout_and_eval_fn:
            self._eval_fn = self._rollout_fn
        else:
            self._eval_fn = instantiate_rollout_fn(
                rollout.effective_eval_function_path, context, what="--eval-function-path"
            )
            self.counts["eval_fns"] += 1

    # --- gated pieces -------------------------------------------------------------------------------------
    @property
    def rollout_fn(self) -> RolloutCallable:
        if self._rollout_fn is None:
            raise not_built("the rollout function", self.config)
        return self._rollout_fn

    @property
    def eval_fn(self) -> RolloutCallable:
        if self._eval_fn is None:
            raise not_built("the eval function", self.config)
        return self._eval_fn

    @property
    def replay_loader(self) -> ReplayLoader:
        if self._replay_loader is None:
            raise NotBuiltError("the replay loader is built only with --load-debug-rollout-data")
        return self._replay_loader

    @property
    def built_generate_state(self) -> GenerateState | None:
        return None if self.context is None else self.context._generate_state

    @property
    def hook_runtime(self) -> HookRuntime | None:
        return None if self.context is None else self.context.hook_runtime

    @property
    def needs_hook_endpoint(self) -> bool:
        """Hooks post to an address: the coordinator serves one when the run generates without a router and a
        custom generate function (or a slime-style rollout function) is in use."""
        context = self.context
        if context is None or context._dispatcher is None or context._dispatcher.router_url is not None:
            return False
        slime_rollout = any(getattr(fn, "posts_to_engines", False) for fn in (self._rollout_fn, self._eval_fn))
        return context.custom_generate is not None or slime_rollout

    # --- the interface the training loop uses ----------------------------------------------------------------
    async def get_rollout(self, rollout_id: int, weight_version: str) -> RolloutBatch:
        if self.config.replay_mode:
            batch = await self.replay_loader.get_rollout(rollout_id, weight_version)
        else:
            batch = await self.rollout_fn(rollout_id, weight_version)
            self._check_shape(batch)
            if self.teacher is not None:
                await self.teacher.score(batch.samples)
            elif self.hook_teacher is not None:
                settle_teacher_log_probs(batch.samples)
                require_teacher_log_probs(batch.samples, hook=self.hook_teacher)
        rollout = self.config.rollout
        if self.config.sft.disable_compute_advantages_and_returns:
            pass  # slime's --disable-compute-advantages-and-returns: the rollout fn's advantages stay
        elif self.reward_post_process is not None:
            self.reward_post_process.apply(batch.groups, normalize_advantages=rollout.normalize_advantages)
            settle_teacher_log_probs(batch.samples)  # slime's OPD post-process sets them (as a tensor)
        else:
            self._advantages(batch)
        if self.config.debug.save_debug_rollout_data is not None and not self.config.replay_mode:
            await self._dump(batch)
        return batch

    def _advantages(self, batch: RolloutBatch) -> None:
        rollout = self.config.rollout
        compute_advantages(
            batch.groups,
            estimator=rollout.advantage_estimator,
            normalize_std=not rollout.disable_grpo_std_normalization,
            reward_key=rollout.reward_key,
            normalize_advantages=rollout.normalize_advantages,
            token_level=self.config.critic.token_level_returns(rollout.advantage_estimator),
        )

    def _check_shape(self, batch: RolloutBatch) -> None:
        rollout = self.config.rollout
        if rollout.rollout_function_path != DEFAULT_ROLLOUT_FUNCTION:
            return  # a custom rollout fn may return any shape (e.g. SFT data); the default one is checked
        want_groups, want_n = rollout.rollout_batch_size, rollout.n_samples_per_prompt
        sizes = [len(group) for group in batch.groups]
        # A custom generate function may return several samples for one (slime's list return).
        custom = self.config.hooks.custom_generate_function_path is not None
        if len(sizes) != want_groups or any(size < want_n if custom else size != want_n for size in sizes):
            raise RuntimeError(
                f"rollout {batch.rollout_id} returned groups of sizes {sizes}; expected "
                f"{want_groups} groups of {want_n}"
            )

    async def _dump(self, batch: RolloutBatch, *, kind: str = "rollout") -> None:
        from coordinator.config.replayed import HEADER_KEY, recorded_flags
        from replay.format import dump_path, write_dump

        path = dump_path(
            self.config.debug.save_debug_rollout_data,
            batch.rollout_id,  # type: ignore[arg-type]
            eval=(kind == "eval"),
        )
        rollout = self.config.rollout
        facts = {
            "hf_checkpoint": rollout.hf_checkpoint,
            "n_samples_per_prompt": rollout.n_samples_per_prompt,
            "rollout_batch_size": rollout.rollout_batch_size,
            "advantage_estimator": rollout.advantage_estimator,
            "reward_key": rollout.reward_key,
            "metrics": batch.metrics,
            HEADER_KEY: recorded_flags(self.config),  # what a replay of this dump trains with by default
        }
        await anyio.to_thread.run_sync(
            lambda: write_dump(path, batch.rollout_id, batch.samples, config_facts=facts, kind=kind)
        )

    def state_dict(self) -> JsonObject:
        if self.context is not None and self.context._data_source is not None:
            return {"data_source": self.context._data_source.state_dict()}
        return {}

    def load_state_dict(self, state: JsonObject) -> None:
        if "data_source" in state and self.context is not None and self.context._data_source is not None:
            self.context._data_source.load_state_dict(state["data_source"])


def sampling_params(rollout: RolloutConfig) -> JsonObject:
    params: dict[str, Any] = {
        "temperature": rollout.rollout_temperature,
        "top_p": rollout.rollout_top_p,
        "top_k": rollout.rollout_top_k,
    }
    if rollout.rollout_stop:
        params["stop"] = list(rollout.rollout_stop)
    if rollout.rollout_stop_token_ids:
        params["stop_token_ids"] = list(rollout.rollout_stop_token_ids)
    return params


def vision_processor(rollout: RolloutConfig) -> VlmProcessor | None:
    """The policy's processor when the prompts hold images (`--multimodal-keys`): the rollout expands each
    prompt's image placeholders and makes the trainer's pixel inputs with it, as slime's processor does."""
    from coordinator.data.tasks import is_image_task
    from workers.vlm_processor import VlmProcessor

    if rollout.hf_checkpoint is None or (rollout.multimodal_key_map is None
                                         and not is_image_task(rollout.prompt_data)):
        return None

    return VlmProcessor(rollout.hf_checkpoint)


def build_data_source(rollout: RolloutConfig, tokenizer: PreTrainedTokenizerBase, *, raw_prompts: bool = False,
                      chat_template: bool = True, render_images: bool = True) -> PromptDataSource:
    """`raw_prompts`: prompts may be any JSON value (a custom generate function reads them); `chat_template`
    False: chats stay messages whatever `--apply-chat-template` says (the SFT rollout templates them itself);
    `render_images` False: a chat with images stays messages (an agent's session renders it)."""
    from coordinator.data.tasks import open_prompt_source

    return open_prompt_source(
        rollout.prompt_data or "",
        input_key=rollout.input_key,
        label_key=rollout.label_key,
        metadata_key=rollout.metadata_key,
        tool_key=rollout.tool_key,
        multimodal_keys=rollout.multimodal_key_map,
        render_images=chat_template and render_images,
        apply_chat_template=rollout.apply_chat_template and chat_template,
        tokenizer=tokenizer,
        shuffle=rollout.rollout_shuffle,
        seed=rollout.rollout_seed,
        raw_prompts=raw_prompts,
        max_line_bytes=rollout.data_max_line_bytes,
    )


def build_reward_model(rollout: RolloutConfig, *, args: argparse.Namespace | None = None) -> RewardModel | None:
    """The rollout's reward; `args`: what a slime-style `--custom-rm-path` gets as its first argument."""
    return RewardChoice.from_rollout(rollout).resolved(rollout.prompt_data).model(args=args)
