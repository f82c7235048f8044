"""What a rollout fn is constructed with (`RolloutContext`): the run's config and exactly the rollout pieces
its mode built. Invariant: a piece the mode did not build raises `NotBuiltError` naming the mode and the flag
that turned it off, never returns None."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import TYPE_CHECKING

from workers.errors import RaylessError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from coordinator.config import Config
    from coordinator.data.source import PromptDataSource
    from coordinator.hooks.runtime import HookRuntime
    from coordinator.rollout.dispatch import Dispatcher
    from coordinator.rollout.filters import DynamicFilter
    from coordinator.rollout.hook_generate import CustomGenerate
    from coordinator.rollout.requests import GenerateState
    from coordinator.rollout.rewards import RewardModel


class NotBuiltError(RaylessError, RuntimeError):
    """A piece of rollout machinery that this run's mode does not build was used."""


def not_built(piece: str, config: Config) -> NotBuiltError:
    if config.replay_mode:
        why = f"--load-debug-rollout-data {config.debug.load_debug_rollout_data!r} replays dumps"
    elif config.debug.debug_train_only:
        why = "--debug-train-only starts no engines"
    elif config.sft.enabled:
        why = "--loss-type sft_loss starts no engines"
    else:
        why = "this run's configuration does not need it"
    return NotBuiltError(f"{piece} is not built in this run: {why}")


class RolloutContext:
    """What a rollout fn is constructed with. Pieces the mode did not build raise NotBuiltError on access."""

    def __init__(
        self,
        *,
        config: Config,
        tokenizer: PreTrainedTokenizerBase,
        data_source: PromptDataSource | None,
        generate_state: GenerateState | None,
        dispatcher: Dispatcher | None,
        reward_model: RewardModel | None,
        dynamic_filter: DynamicFilter | None,
        progress_display: Callable[..., AbstractContextManager[Callable[[], None]]] | None = None,
        hook_runtime: HookRuntime | None = None,
        custom_generate: CustomGenerate | None = None,
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.hook_runtime = hook_runtime
        self.custom_generate = custom_generate
        self._data_source = data_source
        self._generate_state = generate_state
        self._dispatcher = dispatcher
        self._reward_model = reward_model
        self.dynamic_filter = dynamic_filter
        self.progress_display = progress_display or _no_progress

    @property
    def data_source(self) -> PromptDataSource:
        if self._data_source is None:
            raise not_built("the prompt data source (--prompt-data)", self.config)
        return self._data_source

    @property
    def generate_state(self) -> GenerateState:
        if self._generate_state is None:
            raise not_built("GenerateState (engines, tokenizer, request slots)", self.config)
        return self._generate_state

    @property
    def dispatcher(self) -> Dispatcher:
        if self._dispatcher is None:
            raise not_built("the engine dispatcher", self.config)
        return self._dispatcher

    @property
    def reward_model(self) -> RewardModel:
        if self._reward_model is None:
            raise not_built("the reward model (--rm-type / --custom-rm-path)", self.config)
        return self._reward_model


@contextmanager
def _no_progress(title: str, source: object) -> Iterator[Callable[[], None]]:
    yield lambda: None
