"""Generate requests and responses: how samples become `/generate` requests and responses become samples.

Owns, for every path that generates (the default rollout and the eval fleet): `GenerateState` (tokenizer,
sampling defaults, response budget, request slots, base seed), the per-sample sampling seed, the request of
one group on one engine (one batched request without a router, one request per sample through
sglang-router, which refuses batched bodies), and the reading of a checked reply (`GenerateReply`, as the
engine client decoded it once) into its sample (tokens, logprobs, finish reason → status, weight version,
engine). The reply's shape was checked where it was decoded; nothing here parses it again.

Invariants:
- every finish reason maps to a status through `FINISH_STATUS`; any other one is an error, never a guess;
- a sample's seed depends only on (base seed, rollout or eval id, group, index, tokens generated so far), so a
  rerun with the same weights draws the same tokens, and a resumed partial sample draws new ones;
- with logprobs requested, a sample gains one logprob per token it gains (the reply's check guarantees they
  agree in number), or it is an error;
- at most `GenerateState.concurrency` requests are in flight, taken a group at a time (`slots`); states that
  share one `RequestSlots` (rollout and eval on the same engines) share that bound.
"""

from __future__ import annotations

import functools
import uuid
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import anyio

from coordinator.data.source import PromptRecord
from coordinator.engines.replies import FinishReason, GenerateReply
from coordinator.rollout.dispatch import Dispatcher, EngineHandleLike
from replay.sample import FINISH_STATUS, Sample, SampleStatus
from workers.boundary.images import encode_data_url
from workers.boundary.json_input import JsonObject, JsonValue

if TYPE_CHECKING:
    from workers.vlm_processor import VlmProcessor

_SEED_MODULUS = 2**31 - 1


class RequestSlots:
    """The bound on requests in flight, shared by every GenerateState that drives the same engines (the
    rollout's, and the eval's on the rollout engines)."""

    def __init__(self, concurrency: int) -> None:
        self.concurrency = concurrency
        self.free = concurrency
        self._queue = anyio.Lock()  # FIFO: groups take their slots in arrival order
        self._freed = anyio.Event()
        self._waited = False  # whether the group at the head of the queue waits on `_freed`

    @asynccontextmanager
    async def hold(self, count: int) -> AsyncIterator[None]:
        """Hold `count` request slots (clipped to the concurrency), all at once: a group never holds part of
        what it needs while waiting for the rest, so groups cannot starve each other into a deadlock. Only
        the group at the head of the queue waits for slots to free up; the others wait their turn in the
        lock, so a release wakes one task, not every waiting group."""
        count = min(count, self.concurrency)
        async with self._queue:
            while self.free < count:
                self._waited = True
                await self._freed.wait()
            self.free -= count
        try:
            yield
        finally:
            self.free += count
            if self._waited:  # a new Event only when the head of the queue waits on this one (not per group)
                self._waited = False
                self._freed.set()
                self._freed = anyio.Event()


@dataclass
class GenerateState:
    """What generation needs besides engines: tokenizer, sampling defaults, and the concurrency bound.

    `request_slots`: the bound to share (eval on the rollout engines shares the rollout's); by default a new
    one of `concurrency` slots.
    """

    tokenizer: Any
    sampling_params: dict[str, Any]
    max_response_len: int
    context_length: int
    concurrency: int
    seed: int
    request_slots: RequestSlots | None = None
    #: SGLang's `top_logprobs_num` asked with every request (miles' top-k OPD keeps the student's top-k of each
    #: response token in `metadata["opd_student_top_logprobs"]`); 0: not asked
    top_logprobs_num: int = 0
    #: the policy's processor when prompts hold images (`--multimodal-keys`); None: text prompts
    vision: VlmProcessor | None = None

    def __post_init__(self) -> None:
        if self.request_slots is None:
            self.request_slots = RequestSlots(self.concurrency)

    @property
    def free_slots(self) -> int:
        assert self.request_slots is not None
        return self.request_slots.free

    def slots(self, count: int) -> AbstractAsyncContextManager[None]:
        """Hold `count` request slots of the shared bound (`RequestSlots.hold`)."""
        assert self.request_slots is not None
        return self.request_slots.hold(count)

    def encode(self, prompt: str) -> list[int]:
        return list(self.tokenizer(prompt, add_special_tokens=False)["input_ids"])

    def encode_many(self, prompts: list[str]) -> list[list[int]]:
        """`encode` of each prompt, in one call of the tokenizer's batch API: the same ids (the same wrapper and
        encoder, `tests/unit/test_generate_batching.py`), without its Python bookkeeping once per prompt."""
        if not prompts:
            return []
        return [list(ids) for ids in self.tokenizer(prompts, add_special_tokens=False)["input_ids"]]

    def decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=True))

    def decode_many(self, ids: list[list[int]]) -> list[str]:
        """`decode` of each id list. With a fast tokenizer its Rust decoder takes the whole list in one call —
        what `decode` ends in, without transformers' per-call wrapper (~7x cheaper for a short response); a
        tokenizer that adds its own cleanup (`clean_up_tokenization_spaces`) or has no Rust backend is called
        once per list, as `decode`."""
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is None or not _plain_fast_decode(self.tokenizer):
            return [self.decode(one) for one in ids]
        return list(backend.decode_batch(ids, skip_special_tokens=True))

    def max_new_tokens(self, prompt_length: int, already_generated: int = 0) -> int:
        """The response budget of one sample, clipped so prompt + response fits the context length."""
        room = self.context_length - prompt_length
        return max(0, min(self.max_response_len - already_generated, room))


def _plain_fast_decode(tokenizer: object) -> bool:
    """Whether `tokenizer.decode(ids, skip_special_tokens=True)` is its Rust decoder's and nothing more: a
    transformers fast tokenizer whose class overrides neither `decode` nor `_decode`, with no cleanup of spaces."""
    if getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return False
    return _plain_decode_class(type(tokenizer))


@functools.lru_cache(maxsize=32)  # asked once per request: the class's MRO walked once
def _plain_decode_class(cls: type) -> bool:
    for name in ("decode", "_decode"):
        owner = next((base for base in cls.__mro__ if name in vars(base)), None)
        if owner is None or owner.__module__ not in _TRANSFORMERS_DECODERS:
            return False
    return True


#: the transformers modules whose `decode` / `_decode` end in the Rust decoder's call (v4's fast base, v5's)
_TRANSFORMERS_DECODERS = frozenset({"transformers.tokenization_utils_base", "transformers.tokenization_utils_fast",
                                    "transformers.tokenization_utils_tokenizers"})


class GenerateProgress(Protocol):
    """Counters a caller may keep (the rollout's progress line): requests in flight, tokens received."""

    in_flight: int
    generated_tokens: int


def seed_for(seed: int, rollout_id: int, group_index: int, sample_index: int, progress: int) -> int:
    """Deterministic seed of one request: (base seed, rollout or eval id, group, index, how far the sample has
    got — response tokens so far, or the request's context length for a hook's multi-turn request)."""
    value = (seed * 1_000_003 + rollout_id) * 1_000_003 + group_index * 1_009 + sample_index
    return (value + progress * 7_919) % _SEED_MODULUS


def sampling_seed(seed: int, rollout_id: int, sample: Sample) -> int:
    """Deterministic per-sample seed, so a rerun with the same weights draws the same tokens."""
    return seed_for(seed, rollout_id, sample.group_index, sample.sample_index, sample.response_length)


def new_sample(record: PromptRecord, prompt_ids: list[int], group: int, index: int, *,
               n_samples: int | None = None) -> Sample:
    """Sample `index` of prompt group `group`, before anything was generated. The prompt stays what the data
    holds (text, or chat messages / any value a custom generate function reads); `index` is slime's (the
    position in the rollout) when the group size is known."""
    return Sample(
        group_index=group,
        sample_index=index,
        prompt=record.prompt,
        tokens=list(prompt_ids),
        response_length=0,
        loss_mask=[],
        rollout_log_probs=[],
        status=SampleStatus.PENDING,
        label=record.label,
        metadata={**record.metadata, "prompt_index": record.index},
        index=None if n_samples is None else group * n_samples + index,
        multimodal_inputs={"images": list(record.images)} if record.images else None,
    )


def request_params(state: GenerateState, sample: Sample, rollout_id: int) -> JsonObject | None:
    """The sampling params of one sample's request, or None when it has no room left to generate."""
    prompt_length = sample.prompt_length
    budget = state.max_new_tokens(prompt_length, sample.response_length)
    if budget <= 0 and sample.response_length == 0:
        raise ValueError(
            f"prompt {sample.metadata.get('prompt_index')} has {prompt_length} tokens, leaving no room in the "
            f"context length {state.context_length}; shorten it or raise --rollout-max-context-len"
        )
    if budget <= 0:
        sample.status = SampleStatus.TRUNCATED
        return None
    seed = sampling_seed(state.seed, rollout_id, sample)
    return {**state.sampling_params, "max_new_tokens": budget, "sampling_seed": seed}


def with_images(state: GenerateState, record: PromptRecord, prompt_ids: list[int], *, hook: bool = False
                ) -> tuple[list[int], dict[str, object] | None]:
    """slime's processor step for a record with images: its prompt ids with each image placeholder expanded,
    and the trainer's inputs (`multimodal_train_inputs`); a text record's ids unchanged and None.

    `hook`: a custom generate function tokenizes the prompt and processes the images itself (slime's
    contract: it gets the sample's `multimodal_inputs` and sets `multimodal_train_inputs`), so nothing is
    done here; `settle_hook_images` checks what it returns."""
    if not record.images or hook:
        return prompt_ids, None
    if state.vision is None:
        raise TypeError("prompt records hold images but the run has no vision-language processor")
    pixels = state.vision.pixel_inputs(record.images)
    ids = state.vision.expand_ids(prompt_ids, pixels.image_grid_thw)
    return ids, {"pixel_values": pixels.pixel_values, "image_grid_thw": pixels.image_grid_thw}


def settle_hook_images(state: GenerateState, sample: Sample, *, where: str) -> None:
    """A custom generate function's sample with images made whole for the trainer: its `multimodal_inputs`
    images (the prompt's and any a later turn appended) processed into `multimodal_train_inputs` when the hook
    left them unset, then checked to cover every image token of its sequence (else ValueError naming `where`:
    the trainer would score those tokens without their images)."""
    images = (sample.multimodal_inputs or {}).get("images") or []
    if not images and not sample.multimodal_train_inputs:
        return
    if state.vision is None:
        raise ValueError(f"{where}: the sample holds images but --hf-checkpoint is not a vision-language model")
    if not sample.multimodal_train_inputs:
        pixels = state.vision.pixel_inputs(images)
        sample.multimodal_train_inputs = {"pixel_values": pixels.pixel_values,
                                          "image_grid_thw": pixels.image_grid_thw}
    inputs = sample.multimodal_train_inputs
    grid = inputs.get("image_grid_thw")
    if grid is None or inputs.get("pixel_values") is None:
        raise ValueError(f"{where}: multimodal_train_inputs holds {sorted(inputs)}; the trainer needs pixel_values "
                         "and image_grid_thw")
    import torch

    grid = torch.as_tensor(grid, dtype=torch.int64).reshape(-1, 3)
    if images and len(grid) != len(images):
        raise ValueError(f"{where}: multimodal_train_inputs has {len(grid)} image grid(s) for the "
                         f"{len(images)} image(s) of multimodal_inputs")
    try:
        state.vision.check_expanded(sample.tokens, grid)
    except ValueError as error:
        raise ValueError(f"{where}: {error}") from None
    # slime's merge keeps tensors only (Qwen3-VL's list-valued fields dropped, as miles' geo3k rollout does)
    sample.multimodal_train_inputs = {"pixel_values": inputs["pixel_values"], "image_grid_thw": grid}


def image_data(sample: Sample) -> list[JsonValue]:
    """A sample's images as SGLang's `image_data` takes them: PNG data URLs (slime's
    encode_image_for_rollout_engine); the ids sent hold their expanded placeholders, as slime's VLM rollout."""
    images = (sample.multimodal_inputs or {}).get("images") or []
    return [encode_data_url(image) for image in images]


def finish_status(finish: FinishReason | None) -> SampleStatus:
    status = FINISH_STATUS.get(finish.type) if finish is not None else None
    if status is None:
        raise ValueError(f"engine returned an unknown finish_reason {finish!r}")
    return status


def apply_response(state: GenerateState, sample: Sample, reply: GenerateReply, *, logprobs: bool = True,
                   decode: bool = True) -> int:
    """Append one checked reply to its sample (tokens, logprobs, status, text, weight version); returns the
    number of tokens it added. `decode=False`: the caller sets `sample.response` itself (a group's at once,
    `GenerateState.decode_many`)."""
    output_ids = reply.output_ids
    if logprobs and (reply.logprobs is None or len(reply.logprobs) != len(output_ids)):
        count = "no" if reply.logprobs is None else len(reply.logprobs)
        raise ValueError(
            f"engine returned {len(output_ids)} tokens but {count} logprobs for rid {reply.rid}; the engine "
            "must honour return_logprob"
        )
    status = finish_status(reply.finish)
    sample.tokens = [*sample.tokens, *output_ids]
    sample.response_length += len(output_ids)
    sample.loss_mask = sample.loss_mask + [1] * len(output_ids)
    if logprobs and reply.logprobs is not None:
        sample.rollout_log_probs = [*sample.rollout_log_probs, *reply.logprobs]
    if state.top_logprobs_num > 0 and logprobs:  # miles' key: the student's top-k [logprob, id, text] of each response token
        tops = reply.output_top_logprobs
        if not isinstance(tops, list) or len(tops) != len(output_ids):
            count = len(tops) if isinstance(tops, list) else "no"
            raise ValueError(f"engine returned {count} output_top_logprobs for {len(output_ids)} tokens of rid "
                             f"{reply.rid}; top-k OPD needs the engine to honour top_logprobs_num")
        sample.metadata["opd_student_top_logprobs"] = [*sample.metadata.get("opd_student_top_logprobs", []), *tops]
    if decode:
        sample.response = state.decode(sample.response_tokens)
    sample.status = status
    version = "default" if reply.weight_version is None else reply.weight_version
    if not sample.weight_versions or sample.weight_versions[-1] != version:
        sample.weight_versions = [*sample.weight_versions, version]
    return len(output_ids)


async def generate_group(
    state: GenerateState,
    dispatcher: Dispatcher,
    samples: list[Sample],
    rollout_id: int,
    *,
    logprobs: bool = True,
    progress: GenerateProgress | None = None,
) -> list[Sample]:
    """Generate the unfinished samples of one group on one engine; returns `samples`, updated in place.

    Without a router the group is one batched request (one prompt copy per sample, each with its own
    sampling seed): one HTTP round trip instead of n. Through sglang-router, which refuses batched bodies,
    each sample is its own request.
    """
    pending = [sample for sample in samples
               if sample.status not in (SampleStatus.COMPLETED, SampleStatus.TRUNCATED)]
    items = [(sample, request_params(state, sample, rollout_id)) for sample in pending]
    ready = [(sample, params) for sample, params in items if params is not None]
    if not ready:
        return samples

    def received(answered: list[tuple[Sample, GenerateReply]], url: str) -> None:
        """Apply a request's replies to their samples; their texts decoded and the progress counted once for
        them all (one request's replies, or one sample's through the router)."""
        tokens = 0
        for sample, reply in answered:
            sample.metadata["engine"] = url
            tokens += apply_response(state, sample, reply, logprobs=logprobs, decode=False)
        texts = state.decode_many([sample.response_tokens for sample, _ in answered])
        for (sample, _), text in zip(answered, texts, strict=True):
            sample.response = text
        if progress is not None:
            progress.generated_tokens += tokens
            by_engine = getattr(progress, "tokens_by_engine", None)  # the rollout's progress counts per engine
            if by_engine is not None:
                by_engine[url] += tokens

    top: dict[str, JsonValue] = ({"top_logprobs_num": state.top_logprobs_num}
                                 if state.top_logprobs_num > 0 and logprobs else {})

    async def one(sample: Sample, params: dict[str, JsonValue], engine: EngineHandleLike | None) -> None:
        payload: dict[str, JsonValue] = {"input_ids": sample.tokens, "sampling_params": params,
                                         "return_logprob": logprobs, "rid": uuid.uuid4().hex, **top}
        if sample.multimodal_inputs:
            payload["image_data"] = image_data(sample)
        answer, url = await dispatcher.generate(payload, engine=engine)
        (reply,) = answer.replies  # the dispatcher holds an answer to one prompt to one reply
        received([(sample, reply)], url)

    async with dispatcher.group_engine() as engine, state.slots(len(ready)):
        if progress is not None:
            progress.in_flight += len(ready)
        try:
            if dispatcher.router_url is None:
                payload: dict[str, JsonValue] = {
                    "input_ids": [sample.tokens for sample, _ in ready],
                    "sampling_params": [params for _, params in ready],
                    "return_logprob": logprobs,
                    **top,
                }
                if any(sample.multimodal_inputs for sample, _ in ready):
                    payload["image_data"] = [image_data(sample) for sample, _ in ready]
                answer, url = await dispatcher.generate(payload, engine=engine)
                received([(sample, reply) for (sample, _), reply in zip(ready, answer.replies, strict=True)], url)
            else:
                async with anyio.create_task_group() as task_group:
                    for sample, params in ready:
                        task_group.start_soon(one, sample, params, engine)
        finally:
            if progress is not None:
                progress.in_flight -= len(ready)
    return samples
