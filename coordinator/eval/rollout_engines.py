"""Evaluation on the rollout engines: slime's default when no dedicated eval fleet is given.

Owns when an evaluation runs on the rollout engines and what it records. Schedule (slime's `train.py`):
once before the first training rollout when the run starts at rollout 0 (unless `--skip-eval-before-train`),
logged at step 0 with weight version "0"; then after rollout `r` whenever `(r + 1) % --eval-interval == 0`,
after that step's weight update, logged at step `r`. No extra evaluation at the last rollout (as slime).

Each evaluation samples every dataset (`EvalSettings`: `--eval-prompt-data` or `--eval-config`) through the
rollout's own dispatcher (a dead engine is routed around, as for rollouts; with `--use-sglang-router`, through
the router) and the generate path's request code (`coordinator.eval.run`), and writes one metrics row:
`eval/step`, `eval/weight_version`, `eval/duration_s`, `eval/off_version_samples` and each dataset's
`eval/<name>...` metrics. A slime-style or miles class-based `--eval-function-path` (or rollout function serving
eval) evaluates instead, as slime's RolloutManager.eval calls it; its `data` is measured as miles'
`log_eval_rollout_data` does (`eval/<name>`, `-none_reward_ratio`, `-truncated_ratio`, its own metrics).

Invariants: an evaluation runs between training steps (the loop awaits it as a step hook), so no weight update
happens while it generates and every sample is answered by the current weights (`eval/off_version_samples`
counts any that were not: 0 unless an engine misreports its version); its requests share the rollout's bound
on requests in flight (`RequestSlots`), so with `--async-rollout` the rollout being generated meanwhile and
the evaluation together stay within `--sglang-server-concurrency` per engine.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

from coordinator.eval.run import evaluate_dataset, generate_state
from coordinator.eval.settings import EvalDataset, EvalSettings, load_eval_datasets
from coordinator.observe.timeline import span
from coordinator.rollout.slime_rollout_fn import EvalResult, eval_metrics

if TYPE_CHECKING:
    from coordinator.config import Config
    from coordinator.observe.progress import MetricsLog
    from coordinator.rollout.dispatch import Dispatcher
    from coordinator.rollout.hook_generate import CustomGenerate
    from coordinator.rollout.manager import RolloutManager
    from coordinator.rollout.requests import GenerateState

log = logging.getLogger(__name__)

#: a slime/miles eval function's call: (rollout_id, weight_version) -> its data and metrics
EvalFunction = Callable[[int, str], Awaitable[EvalResult]]


class RolloutEngineEval:
    """A training-loop step hook (`after_step`) and loop phase (`before_loop`: slime's evaluation at rollout 0).

    Args:
        settings: the eval flags (`EvalSettings.from_slices`).
        datasets: the loaded eval datasets (`load_eval_datasets`).
        rollout_state: the rollout's GenerateState: its tokenizer, context length and request slots are used.
        dispatcher: the rollout's dispatcher.
        metrics: the run's MetricsLog (None: records only).
    """

    def __init__(self, *, settings: EvalSettings, datasets: Sequence[EvalDataset], rollout_state: GenerateState,
                 dispatcher: Dispatcher, metrics: MetricsLog | None = None,
                 custom_generate: CustomGenerate | None = None, eval_fn: EvalFunction | None = None) -> None:
        self.settings = settings
        self.custom_generate = custom_generate
        self.eval_fn = eval_fn
        self.datasets = list(datasets)
        self.dispatcher = dispatcher
        self.metrics = metrics
        self.states = {
            dataset.name: generate_state(dataset, tokenizer=rollout_state.tokenizer,
                                         context_length=min(settings.max_context_len or rollout_state.context_length,
                                                            rollout_state.context_length),
                                         concurrency=rollout_state.concurrency,
                                         request_slots=rollout_state.request_slots)
            for dataset in self.datasets
        }
        self.records: list[dict[str, Any]] = []
        self._next_id = 0

    @classmethod
    def from_run(cls, config: Config, manager: RolloutManager, metrics: MetricsLog | None) -> RolloutEngineEval:
        """Built from the run's config and its rollout manager (after the engines and tokenizer are up)."""
        assert manager.context is not None
        settings = EvalSettings.from_slices(config.eval, rollout=config.rollout, sglang=config.sglang)
        runtime = manager.context.hook_runtime
        datasets = load_eval_datasets(settings, manager.context.tokenizer,
                                      hook_args=runtime.args if runtime is not None else None,
                                      raw_prompts=manager.context.custom_generate is not None)
        # a slime/miles eval function (its own `evaluate`: slime's evaluation=True call, miles' RolloutFnEvalInput)
        # evaluates instead of the built-in datasets, as slime's RolloutManager.eval calls it
        eval_fn = getattr(manager.eval_fn, "evaluate", None) if config.builds_rollout_fn else None
        return cls(settings=settings, datasets=datasets, rollout_state=manager.context.generate_state,
                   dispatcher=manager.context.dispatcher, metrics=metrics,
                   custom_generate=manager.context.custom_generate, eval_fn=eval_fn)

    def due(self, rollout_id: int) -> bool:
        interval = self.settings.interval
        return interval is not None and (rollout_id + 1) % interval == 0

    async def before_loop(self, start_rollout: int, weight_version: str) -> None:
        """slime evaluates once before the first rollout of a run that starts at rollout 0."""
        if start_rollout == 0 and self.settings.interval is not None and not self.settings.skip_before_train:
            await self.evaluate(0, weight_version)

    async def after_loop(self) -> None:
        """Every evaluation runs inside `after_step`: nothing is left in flight."""

    async def after_step(self, rollout_id: int, weight_version: str) -> None:
        """Training-loop hook: evaluate the weights just synced to the engines when an evaluation is due."""
        if self.due(rollout_id):
            with span("eval", ("eval", "rollout engines"), step=rollout_id):
                await self.evaluate(rollout_id, weight_version)

    async def evaluate(self, step: int, weight_version: str) -> dict[str, Any]:
        """Evaluate every dataset now; the metrics row is logged at `step` and returned."""
        started = time.monotonic()
        eval_id, self._next_id = self._next_id, self._next_id + 1
        row: dict[str, Any] = {"eval/step": step, "eval/weight_version": weight_version}
        if self.eval_fn is not None:
            return self._log(step, weight_version, started,
                             {**row, **eval_metrics(await self.eval_fn(step, weight_version))})
        off_version = 0
        for dataset in self.datasets:
            groups, metrics = await evaluate_dataset(dataset, self.states[dataset.name], self.dispatcher, eval_id,
                                                     custom=self.custom_generate)
            row.update(metrics)
            off_version += sum(sample.weight_versions != [weight_version] for group in groups for sample in group)
        row["eval/off_version_samples"] = float(off_version)
        return self._log(step, weight_version, started, row)

    def _log(self, step: int, weight_version: str, started: float, row: dict[str, Any]) -> dict[str, Any]:
        row["eval/duration_s"] = time.monotonic() - started
        if self.metrics is not None:
            self.metrics.log(step, row)
        self.records.append(row)
        names = [key for key in row if key.startswith("eval/") and key.count("/") == 1 and "-" not in key
                 and key not in ("eval/step", "eval/weight_version", "eval/off_version_samples")]
        log.info("eval at step %d (weights %s): %s", step, weight_version,
                 "  ".join(f"{name[5:]} reward {row[name]:.3f}" for name in names if isinstance(row[name], float)))
        return row
