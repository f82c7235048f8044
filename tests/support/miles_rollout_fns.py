"""Rollout classes written against miles' class-based rollout API (`miles.rollout.base_types`), ported by their
imports only (`from coordinator.hooks import ...`), for --rollout-function-path / --eval-function-path.

`VerifiersShapedRolloutFn` has the shape of miles' `examples/experimental/verifiers/verifiers_rollout.py`
`VerifiersRolloutFn`: built from `RolloutFnConstructorInput` (keeps `args` and `data_source`, sizes its
concurrency from `rollout_num_gpus // rollout_num_gpus_per_engine * sglang_server_concurrency`), an
`async __call__(input)` dispatching on `input.evaluation` to `_call_train` (groups from the data source,
generated and scored, `RolloutFnTrainOutput(samples, metrics)`) or `_call_eval` (`RolloutFnEvalOutput(data,
metrics)`). The environment is replaced by slime's one-turn `generate` and an exact first-digit reward.
`SyncFixedRolloutFn` is a miles class with a plain `__call__` that builds fixed samples (no engines).
`SnapshotReadingEvalFn` is a miles `CheckpointEvalFn` (`--eval-function-path`) evaluating snapshot directories.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, ClassVar

from coordinator.hooks import (
    CheckpointEvalFn,
    EvalSkip,
    GenerateState,
    RolloutFnConstructorInput,
    RolloutFnEvalInput,
    RolloutFnEvalOutput,
    RolloutFnInput,
    RolloutFnOutput,
    RolloutFnTrainInput,
    RolloutFnTrainOutput,
    Sample,
    generate,
    run,
)

EVAL_PROMPTS = [("3 7 1=", "3"), ("5 2 8=", "5"), ("9 4 4=", "9"), ("1 6 2=", "1")]


def _first_digit_reward(sample: Sample) -> float:
    return float(sample.response.strip()[:1] == str(sample.label))


class VerifiersShapedRolloutFn:
    INSTANCES: ClassVar[list[VerifiersShapedRolloutFn]] = []

    def __init__(self, input: RolloutFnConstructorInput) -> None:
        self.args = input.args
        self.data_source = input.data_source
        engine_count = self.args.rollout_num_gpus // self.args.rollout_num_gpus_per_engine
        self.max_concurrent = self.args.sglang_server_concurrency * engine_count
        self.inputs: list[RolloutFnInput] = []
        VerifiersShapedRolloutFn.INSTANCES.append(self)

    async def __call__(self, input: RolloutFnInput) -> RolloutFnOutput:
        self.inputs.append(input)
        return await (self._call_eval(input) if input.evaluation else self._call_train(input))

    async def _generate_and_score(self, samples: list[Sample]) -> None:
        state = GenerateState(self.args)
        semaphore = asyncio.Semaphore(self.max_concurrent)

        async def one(sample: Sample) -> None:
            async with semaphore:
                await generate(self.args, sample, dict(state.sampling_params))
            sample.reward = _first_digit_reward(sample)

        await asyncio.gather(*(one(sample) for sample in samples))

    async def _call_train(self, input: RolloutFnTrainInput) -> RolloutFnTrainOutput:
        groups = self.data_source.get_samples(self.args.rollout_batch_size)
        await self._generate_and_score([sample for group in groups for sample in group])
        return RolloutFnTrainOutput(samples=groups, metrics={"verifiers/weight_version": input.weight_version})

    async def _call_eval(self, input: RolloutFnEvalInput) -> RolloutFnEvalOutput:
        samples = [Sample(index=i, prompt=prompt, label=label) for i, (prompt, label) in enumerate(EVAL_PROMPTS)]
        await self._generate_and_score(samples)
        data = {"digits": {"rewards": [sample.reward for sample in samples],
                           "truncated": [sample.status is Sample.Status.TRUNCATED for sample in samples],
                           "samples": samples}}
        return RolloutFnEvalOutput(data=data, metrics={"verifiers/eval_rollout_id": input.rollout_id})


class SyncFixedRolloutFn:
    """miles' form with a plain `__call__` (miles runs it in a thread); builds fixed samples, generates nothing."""

    INPUTS: ClassVar[list[Any]] = []

    def __init__(self, input: RolloutFnConstructorInput) -> None:
        self.args = input.args

    def __call__(self, input: RolloutFnInput) -> RolloutFnOutput:
        SyncFixedRolloutFn.INPUTS.append(input)
        run(asyncio.sleep(0))  # a sync rollout fn reaches the run's loop through `run`, as miles' do
        if input.evaluation:
            return RolloutFnEvalOutput(data={"fixed": {"rewards": [1.0, None], "truncated": [False, True]}})
        group = [Sample(prompt="1 2 3=", tokens=[8, 9, 10, 11], response_length=2, loss_mask=[1, 1],
                        rollout_log_probs=[-1.0, -2.0], reward=float(k), status=Sample.Status.COMPLETED,
                        weight_versions=[str(input.weight_version)]) for k in range(2)]
        return RolloutFnTrainOutput(samples=[group], metrics={"fixed/groups": 1})


class SnapshotReadingEvalFn(CheckpointEvalFn):
    """miles' `CheckpointEvalFn` (`examples/infra_features/fully_async/external_eval_fn.py`'s shape): a backend of
    its own that gets each snapshot directory. This one reads the weight version the export wrote there and the
    model's config (the directory is a complete Hugging Face checkpoint), and skips the point of weight version
    `SKIP_VERSION` with `EvalSkip("backend_busy")`, as a busy external service would."""

    CALLS: ClassVar[list[tuple[int, str | None, str, str, list[str]]]] = []
    DISPOSED: ClassVar[list[bool]] = []
    SKIP_VERSION: ClassVar[str | None] = None

    def __init__(self, input: RolloutFnConstructorInput) -> None:
        self.args = input.args

    async def evaluate_checkpoint(self, checkpoint_dir: str, input: RolloutFnEvalInput) -> RolloutFnEvalOutput:
        directory = Path(checkpoint_dir)
        marker = directory / "rayless_weight_version.txt"
        version = marker.read_text().strip() if marker.is_file() else "base"
        assert (directory / "config.json").is_file() and (directory / "model.safetensors").is_file()
        siblings = sorted(path.name for path in directory.parent.iterdir())
        SnapshotReadingEvalFn.CALLS.append((input.rollout_id, input.weight_version, checkpoint_dir, version,
                                            siblings))
        if input.weight_version == SnapshotReadingEvalFn.SKIP_VERSION:
            raise EvalSkip("backend_busy")
        return RolloutFnEvalOutput(data={"snapshot": {"rewards": [1.0, 0.0], "truncated": [False, False]}},
                                   metrics={"snapshot/version_read": -1.0 if version == "base" else float(version)})

    def dispose(self) -> None:
        SnapshotReadingEvalFn.DISPOSED.append(True)
