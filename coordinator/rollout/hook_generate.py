"""`--custom-generate-function-path`: a slime-style generate function in place of our request code.

Owns how the rollout (and evaluation on the rollout engines) calls a user's generate function for the samples
of one prompt group: all of them concurrently, within the group's request slots (slime holds its semaphore
around each call), with the group's engine fixed for the whole call (the route `post` sends to the
coordinator's endpoint, which keeps the group on that engine while it lives), each call with its own copy
of the sampling params and slime's `evaluation=` when the function takes it. What comes back is checked and
settled into our invariant (`replay.sample.settle_hook_fields`): a `Sample`, or a list of them (slime's
multi-sample return: they replace the one sample in its group, in order).

What the function raises: an `Exception` stops the run, naming the function's file and line; `SystemExit`,
`KeyboardInterrupt` or a `CancelledError` of its own (`coordinator.hooks.calls.HookEscaped`) fails that episode:
the sample comes back ABORTED with no response (generated again, counted as aborted, logged with the traceback),
never as a sample without tokens for training; so does a call past `--custom-generate-timeout-s`
(`HookTimeout`); `--hook-max-failures-in-a-row` such failures with no success between them stop the run
(`HookBudgetSpent`, from `call_hook`: a function that always exits would otherwise be called for ever).

Invariants: a hook's sample keeps its group (`group_index`) and gets `index` / `sample_index` from its place;
a reward the hook set is kept (the reward model skips it), any other reward is cleared before the call; the
hook's tokens, response length, loss mask and rollout logprobs agree (else an error naming the hook); the
number of requests in flight for the group never exceeds the slots the group holds.

Images (slime's `geo3k_vlm_multi_turn` shape): the function gets the sample's `multimodal_inputs` (the prompt's
decoded images) and `GenerateState(args).processor` (the model's, `workers.vlm_processor.VlmProcessor`), sends
`image_data` itself, and may append a later turn's images; what comes back has `multimodal_train_inputs`
covering every image token of its sequence (made from `multimodal_inputs` when it left them unset), else a
HookError naming it.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import anyio

from coordinator.hooks.calls import HookEscaped, call_hook, log_escape
from coordinator.hooks.forms import HookForm, Reading, read_generate
from coordinator.hooks.runtime import GenerateFnInput, GroupRoute, HookError, HookRuntime, Route, hook_call
from coordinator.rollout.dispatch import Dispatcher
from coordinator.rollout.requests import GenerateProgress, GenerateState, settle_hook_images
from replay.sample import Sample, SampleError, SampleStatus, settle_hook_fields
from workers.boundary.json_input import JsonObject
from workers.hook_loading import load_object

FLAG = "--custom-generate-function-path"
#: Samples a generate function has nothing more to do for.
DONE = (SampleStatus.COMPLETED, SampleStatus.TRUNCATED, SampleStatus.FAILED)


class CustomGenerate:
    """A loaded generate function and how to call it (`coordinator.hooks.forms.read_generate`)."""

    def __init__(self, fn: Callable[..., object], *, path: str, runtime: HookRuntime,
                 dispatcher: Dispatcher) -> None:
        self.fn = fn
        self.path = path
        self.reading: Reading = read_generate(FLAG, path, fn)
        self.runtime = runtime
        self.dispatcher = dispatcher

    @classmethod
    def load(cls, path: str, *, runtime: HookRuntime, dispatcher: Dispatcher) -> CustomGenerate:
        return cls(load_object(path, what=FLAG), path=path, runtime=runtime, dispatcher=dispatcher)

    async def generate_group(self, samples: list[Sample], rollout_id: int, *, state: GenerateState,
                             sampling_params: JsonObject, evaluation: bool = False,
                             progress: GenerateProgress | None = None) -> list[Sample]:
        """The group after its unfinished samples went through the hook: finished ones as they were, each
        hook's result in place of its sample (a list of samples flattened in), `sample_index` renumbered."""
        pending = [sample for sample in samples if sample.status not in DONE]
        if not pending:
            return samples
        results: dict[int, list[Sample]] = {}
        async with self.dispatcher.group_engine() as engine, state.slots(len(pending)):
            route = GroupRoute(rollout_id=rollout_id, group_index=samples[0].group_index, engine=engine)
            if progress is not None:
                progress.in_flight += len(pending)
            try:
                async with anyio.create_task_group() as task_group:
                    for sample in pending:
                        task_group.start_soon(self._one, sample, route, sampling_params, evaluation, results,
                                              progress, state)
            finally:
                if progress is not None:
                    progress.in_flight -= len(pending)
        group: list[Sample] = []
        for sample in samples:
            group += results.get(id(sample), [sample])
        for position, sample in enumerate(group):
            sample.sample_index = position
        return group

    async def _one(self, sample: Sample, route: GroupRoute, sampling_params: JsonObject, evaluation: bool,
                   results: dict[int, list[Sample]], progress: GenerateProgress | None,
                   state: GenerateState) -> None:
        sample.reward = None  # the hook may set one (then the reward model leaves it)
        before = sample.response_length
        params = copy.deepcopy(sampling_params)
        with self.runtime.routes.open(Route(route, sample.sample_index)) as token, hook_call(self.runtime, token):
            try:
                returned = await self._call(sample, params, evaluation)
            except HookEscaped as escaped:
                self._escaped(escaped, sample)
                return
        produced = self._settle(returned, sample, state)
        results[id(sample)] = produced
        if progress is not None:
            progress.generated_tokens += max(sum(s.response_length for s in produced) - before, 0)

    def _escaped(self, escaped: HookEscaped, sample: Sample) -> None:
        """The episode failed: the sample goes back ABORTED, without a response, to be generated again (the
        failure was counted by `call_hook`, which stops the run once the budget is spent)."""
        where = f"sample {sample.group_index}/{sample.sample_index}"
        log_escape(escaped, f"{where}'s episode failed; the sample is generated again")
        sample.status = SampleStatus.ABORTED
        sample.tokens = sample.tokens[:sample.prompt_length]
        sample.response_length, sample.response = 0, ""
        sample.loss_mask, sample.rollout_log_probs, sample.weight_versions = [], [], []
        sample.reward = None

    async def _call(self, sample: Sample, params: JsonObject, evaluation: bool) -> object:
        args = self.runtime.args
        what = f"{FLAG} {self.path!r}"
        if self.reading.form is HookForm.MILES:
            output = await call_hook(self.fn, GenerateFnInput(state=self.runtime.generate_state, sample=sample,
                                                               sampling_params=params, evaluation=evaluation,
                                                               args=args), what=what, kind="generate")
            return getattr(output, "samples", output)
        if self.reading.passes_evaluation:
            return await call_hook(self.fn, args, sample, params, what=what, kind="generate", evaluation=evaluation)
        return await call_hook(self.fn, args, sample, params, what=what, kind="generate")

    def _settle(self, returned: object, original: Sample, state: GenerateState) -> list[Sample]:
        where = f"{FLAG} {self.path!r} (sample {original.group_index}/{original.sample_index})"
        produced = returned if isinstance(returned, list) else [returned]
        if not produced or not all(isinstance(sample, Sample) for sample in produced):
            kinds = sorted({type(sample).__name__ for sample in produced}) or ["an empty list"]
            raise HookError(f"{where} returned {', '.join(kinds)}; expected the Sample (coordinator.hooks.Sample) "
                            "or a non-empty list of them")
        for sample in produced:
            sample.group_index = original.group_index
            try:
                settle_hook_fields(sample, where=where)
                settle_hook_images(state, sample, where=where)
            except (SampleError, ValueError) as error:
                raise HookError(str(error)) from None
        return produced
