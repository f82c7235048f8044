"""The hook API, shaped like slime's: a slime hook ports to rayless by changing its import lines only.

    from coordinator.hooks import GenerateState   # was: from slime.rollout.sglang_rollout import GenerateState
    from coordinator.hooks import post            # was: from slime.utils.http_utils import post
    from coordinator.hooks import Sample          # was: from slime.utils.types import Sample

What a hook gets (docs/hooks.md):
- `Sample` (`replay.sample.Sample`): slime's field names, `Sample.Status` (PENDING, COMPLETED, TRUNCATED,
  ABORTED, FAILED), `append_response_tokens`, `get_reward_value`, attributes added on the fly;
- `args`: slime's attribute names, from the run's flags (`coordinator.hooks.args`); `args.sglang_router_ip` /
  `args.sglang_router_port` reach every live rollout engine through our dispatch (the coordinator's endpoint,
  `coordinator.rollout.hook_endpoint`, or the router in use);
- `GenerateState(args)`: the tokenizer, slime's default `sampling_params`, and `semaphore` (the run's bound on
  requests in flight);
- `post(url, payload)` / `get(url)`: HTTP on our client (deadlines, bounded retries, the API key to our
  address only); `run(coro)` for synchronous hook code (slime's `async_utils.run`);
- `generate(args, sample, sampling_params)`: slime's default one-turn generate; `DynamicFilterOutput`,
  miles' `GenerateFnInput` / `GenerateFnOutput`, and miles' rollout-function records
  (`RolloutFnConstructorInput`, `RolloutFnTrainInput` / `RolloutFnEvalInput`, `RolloutFnTrainOutput` /
  `RolloutFnEvalOutput`: `coordinator.hooks.rollout_types`); miles' `CheckpointEvalFn` / `EvalSkip` for an
  `--eval-function-path` that evaluates snapshot directories (`coordinator.hooks.checkpoint_eval`).

Importing this package imports neither torch nor transformers.
"""

from __future__ import annotations

from dataclasses import dataclass

from coordinator.hooks.checkpoint_eval import CheckpointEvalFn, EvalSkip
from coordinator.hooks.http import get, post
from coordinator.hooks.rollout_types import (
    RolloutFnBaseInput,
    RolloutFnConstructorInput,
    RolloutFnEvalInput,
    RolloutFnEvalOutput,
    RolloutFnInput,
    RolloutFnOutput,
    RolloutFnTrainInput,
    RolloutFnTrainOutput,
)
from coordinator.hooks.runtime import GenerateFnInput, GenerateFnOutput, HookError, SlimeGenerateState
from coordinator.hooks.single_turn import generate
from coordinator.hooks.sync import run
from replay.sample import Sample, SampleStatus

#: slime's `GenerateState(args)`.
GenerateState = SlimeGenerateState
Status = SampleStatus


@dataclass
class DynamicFilterOutput:
    """slime's `filter_hub.base_types.DynamicFilterOutput`."""

    keep: bool
    reason: str | None = None
    keep_when_insufficient: bool = False


__all__ = [
    "CheckpointEvalFn",
    "DynamicFilterOutput",
    "EvalSkip",
    "GenerateFnInput",
    "GenerateFnOutput",
    "GenerateState",
    "HookError",
    "RolloutFnBaseInput",
    "RolloutFnConstructorInput",
    "RolloutFnEvalInput",
    "RolloutFnEvalOutput",
    "RolloutFnInput",
    "RolloutFnOutput",
    "RolloutFnTrainInput",
    "RolloutFnTrainOutput",
    "Sample",
    "Status",
    "generate",
    "get",
    "post",
    "run",
]
