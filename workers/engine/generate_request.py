"""Turning a `/generate` body into sequences: the whole request validated before any of it runs.

Owns the input rules of /generate (and so of the `/v1` routes, which map onto it): exactly one of `text` /
`input_ids`, ids inside the vocabulary, prompts shorter than the context length, prompts x n within
`--max-seqs-per-request`, per-prompt lists of the right length, booleans and integers of the right type and
range. An unknown sampling key is a 400 naming the key (SGLang answers a plain-text 500).

Invariants: every rejected input is a `RequestError` (a 4xx, never a 500 from a TypeError or a RecursionError),
raised before anything reaches the scheduler, so one client's request cannot break another's; text is
tokenized off the event loop.

SGLang's `image_data` (a vision-language model only): one image or a list per prompt, each a base64 data URL,
a `file://` URL or a path on the engine's host, decoded under `workers.boundary.images`' bounds off the event
loop. With `input_ids` the ids must already hold each image's expanded `<|image_pad|>` run (as slime's
multi-turn VLM rollout sends them, from the processor); with `text` the template's single placeholder per image
is expanded here, so the ids the sequence keeps are the expanded ones either way.
"""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING, Protocol

import anyio

from workers.boundary.errors import BoundaryError
from workers.boundary.images import decode_image
from workers.boundary.json_input import JsonObject, JsonValue
from workers.engine.sampling import RequestError, parse_sampling_params
from workers.engine.sampling_params import INT64_MAX, show
from workers.engine.sequences import RequestGroup, Seq
from workers.vlm_processor import PixelInputs, VlmInputError

if TYPE_CHECKING:
    from workers.engine.args import EngineArgs
    from workers.engine.runner import ModelRunner
    from workers.engine.scheduler import Scheduler


class RequestCore(Protocol):
    """What request building uses of the engine (`workers.engine.server.EngineServer`)."""

    args: EngineArgs
    runner: ModelRunner
    scheduler: Scheduler
    context_length: int

    @property
    def weight_version(self) -> str: ...


class RequestBuilder:
    """Validates /generate bodies against one engine's model and limits, and makes their sequences."""

    def __init__(self, server: RequestCore) -> None:
        self.server = server

    def _encode(self, texts: list[str]) -> list[list[int]]:
        """Tokenize (blocking; run in a worker thread). A text whose first `probe` characters already make
        far more tokens than the context holds is refused without tokenizing the rest of it."""
        tokenizer, limit = self.server.runner.tokenizer, self.server.context_length
        probe = 8 * limit + 1024
        prompts = []
        for text in texts:
            if len(text) > probe:
                head = len(tokenizer.encode(text[:probe]))
                # The last word of the cut can tokenize differently; 2x the context is beyond any such slack.
                if head > 2 * limit + 16:
                    raise RequestError(
                        f"The input (over {head} tokens) is longer than the model's context length "
                        f"({limit} tokens)."
                    )
            prompts.append(tokenizer.encode(text))
        return prompts

    async def _prompts(self, body: JsonObject) -> tuple[list[list[int]], bool]:
        text, input_ids = body.get("text"), body.get("input_ids")
        if (text is None) == (input_ids is None):
            raise RequestError("give exactly one of 'text' or 'input_ids'")
        if text is not None:
            if isinstance(text, str):
                texts, batched = [text], False
            elif isinstance(text, list) and all(isinstance(t, str) for t in text):
                texts, batched = text, True
            else:
                raise RequestError("'text' must be a string or a list of strings")
            if not texts or any(not t for t in texts):
                raise RequestError("the input is empty")
            self._check_count(len(texts), 1)
            # Off the event loop: a 5 MB prompt takes seconds to tokenize, and /health must answer meanwhile.
            prompts = await anyio.to_thread.run_sync(self._encode, texts)
        else:
            if isinstance(input_ids, list) and input_ids and all(isinstance(i, list) for i in input_ids):
                prompts, batched = input_ids, True
            elif isinstance(input_ids, list):
                prompts, batched = [input_ids], False
            else:
                raise RequestError("'input_ids' must be a list of ints or a list of lists of ints")
            self._check_count(len(prompts), 1)
            if sum(len(ids) for ids in prompts) > 100_000:  # a long list takes a while to check: off the loop
                await anyio.to_thread.run_sync(self._check_ids, prompts)
            else:
                self._check_ids(prompts)
        if not prompts or any(len(ids) == 0 for ids in prompts):
            raise RequestError("the input is empty")
        for ids in prompts:
            if len(ids) >= self.server.context_length:
                raise RequestError(
                    f"The input ({len(ids)} tokens) is longer than the model's context length "
                    f"({self.server.context_length} tokens)."
                )
        return [list(ids) for ids in prompts], batched

    def _check_ids(self, prompts: list[JsonValue]) -> None:
        vocab = self.server.runner.vocab_size
        for ids in prompts:
            if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
                raise RequestError("'input_ids' must contain integers only")
            if any(not 0 <= i < vocab for i in ids):
                raise RequestError(f"'input_ids' has ids outside the vocabulary [0, {vocab})")

    def _check_count(self, prompts: int, n: int) -> None:
        limit = self.server.args.max_seqs_per_request
        if prompts * n > limit:
            raise RequestError(
                f"the request makes {prompts} prompt(s) x n={n} = {prompts * n} sequences, over the engine's "
                f"--max-seqs-per-request ({limit})"
            )

    @staticmethod
    def _per_item(value: JsonValue, count: int, name: str) -> list[JsonValue]:
        if isinstance(value, list):
            if len(value) != count:
                raise RequestError(f"'{name}' has {len(value)} entries for {count} prompts")
            return value
        return [value] * count

    @staticmethod
    def _flag(body: JsonObject, key: str) -> bool:
        value = body.get(key)
        if value is None:
            return False
        if not isinstance(value, bool):
            raise RequestError(f"'{key}' must be true or false, got {show(value)}")
        return value

    def _int_field(self, value: JsonValue, name: str, low: int) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= INT64_MAX:
            raise RequestError(f"{name} must be an integer in [{low}, 2**63 - 1], got {show(value)}")
        return value

    def _token_ids_logprob(self, value: JsonValue, count: int) -> list[tuple[int, ...]]:
        """SGLang's `token_ids_logprob`: one list of ids for every prompt, or one list per prompt (a list of
        lists); each id in the vocabulary."""
        if value is None:
            return [()] * count
        if not isinstance(value, list):
            raise RequestError(f"'token_ids_logprob' must be a list of token ids, got {show(value)}")
        per_prompt = value if value and isinstance(value[0], list) else [value] * count
        if len(per_prompt) != count:
            raise RequestError(f"'token_ids_logprob' has {len(per_prompt)} lists for {count} prompts")
        vocab = self.server.runner.vocab_size
        for ids in per_prompt:
            if not isinstance(ids, list) or not all(
                    isinstance(i, int) and not isinstance(i, bool) and 0 <= i < vocab for i in ids):
                raise RequestError(f"'token_ids_logprob' must hold token ids in [0, {vocab}), got {show(ids)}")
        return [tuple(ids) for ids in per_prompt]  # type: ignore[arg-type]

    def _position_token_ids(self, value: JsonValue, prompts: list[list[int]]
                            ) -> list[tuple[tuple[int, ...], ...] | None]:
        """miles' patched-SGLang `token_ids_logprob_positions`: one list of ids per input position (from position
        0) of a single prompt, or one such list per prompt; each id in the vocabulary."""
        if value is None:
            return [None] * len(prompts)
        nested = isinstance(value, list) and value and isinstance(value[0], list) and value[0] \
            and isinstance(value[0][0], list)
        per_prompt = value if nested else [value]
        if not isinstance(value, list) or not isinstance(per_prompt, list) or len(per_prompt) != len(prompts):
            raise RequestError(f"'token_ids_logprob_positions' must be one list of ids per input position of "
                               f"each of the {len(prompts)} prompts")
        vocab = self.server.runner.vocab_size
        out: list[tuple[tuple[int, ...], ...] | None] = []
        for positions, ids in zip(per_prompt, prompts, strict=True):
            if not isinstance(positions, list) or len(positions) != len(ids) or not all(
                    isinstance(row, list) and all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < vocab
                                                  for i in row) for row in positions):
                raise RequestError(f"'token_ids_logprob_positions' must hold {len(ids)} lists (one per input "
                                   f"position) of token ids in [0, {vocab})")
            out.append(tuple(tuple(row) for row in positions))  # type: ignore[arg-type,union-attr]
        return out

    async def _images(self, body: JsonObject, prompts: list[list[int]], *, from_text: bool
                      ) -> list[PixelInputs | None]:
        """`image_data` decoded and processed per prompt (None: a prompt without images); text prompts' image
        placeholders are expanded in `prompts` in place."""
        value = body.get("image_data")
        if value is None or value == []:
            return [None] * len(prompts)
        processor = self.server.runner.vision_processor
        if processor is None:
            raise RequestError("'image_data': this engine's model is not a vision-language model")
        per_prompt = value if len(prompts) > 1 or (isinstance(value, list) and value
                                                   and isinstance(value[0], list)) else [value]
        if not isinstance(per_prompt, list) or len(per_prompt) != len(prompts):
            raise RequestError(f"'image_data' must hold one image or list of images per prompt ({len(prompts)})")

        def process() -> list[PixelInputs | None]:
            out: list[PixelInputs | None] = []
            for index, (ids, images) in enumerate(zip(prompts, per_prompt, strict=True)):
                images = images if isinstance(images, list) else [images]
                if not images:
                    out.append(None)
                    continue
                decoded = [decode_image(image, f"image_data[{index}][{position}]")
                           for position, image in enumerate(images)]
                vision = processor.pixel_inputs(decoded)
                if from_text:
                    ids[:] = processor.expand_ids(ids, vision.image_grid_thw)
                else:
                    processor.check_expanded(ids, vision.image_grid_thw)
                out.append(vision)
            return out

        try:
            visions = await anyio.to_thread.run_sync(process)
        except (BoundaryError, VlmInputError) as error:
            raise RequestError(f"'image_data': {error}") from None
        for ids in prompts:
            if len(ids) >= self.server.context_length:
                raise RequestError(f"The input ({len(ids)} tokens with its images) is longer than the model's "
                                   f"context length ({self.server.context_length} tokens).")
        return visions

    async def build(self, body: JsonObject, *, expand_images: bool = False) -> tuple[list[Seq], bool, RequestGroup]:
        """Validate the whole request and make its sequences; nothing reaches the scheduler before this
        returns, so a bad request is refused whole and never joins (or breaks) the running batch.
        `expand_images`: the `input_ids` were rendered from a chat here (one placeholder an image, as a text
        prompt's), not sent expanded."""
        if body.get("lora_path") is not None:
            raise RequestError("'lora_path': LoRA adapters are not supported by the rayless engine")
        stream = self._flag(body, "stream")
        self._flag(body, "return_text_in_logprobs")
        prompts, batched = await self._prompts(body)
        count = len(prompts)
        visions = await self._images(body, prompts, from_text=body.get("text") is not None or expand_images)
        params_list = [
            parse_sampling_params(p, vocab_size=self.server.runner.vocab_size, max_n=self.server.args.max_n)
            for p in self._per_item(body.get("sampling_params"), count, "sampling_params")
        ]
        total_seqs = sum(params.n for params in params_list)
        if total_seqs > self.server.args.max_seqs_per_request:
            self._check_count(count, max(params.n for params in params_list))
        rids = self._per_item(body.get("rid"), count, "rid")
        return_logprob = self._per_item(body.get("return_logprob", False), count, "return_logprob")
        start_lens = self._per_item(body.get("logprob_start_len", -1), count, "logprob_start_len")
        top_nums = self._per_item(body.get("top_logprobs_num", 0), count, "top_logprobs_num")
        token_ids = self._token_ids_logprob(body.get("token_ids_logprob"), count)
        position_ids = self._position_token_ids(body.get("token_ids_logprob_positions"), prompts)
        group = RequestGroup(stream=stream)
        seqs: list[Seq] = []
        for index, (ids, params) in enumerate(zip(prompts, params_list, strict=True)):
            left = self.server.context_length - len(ids)
            max_new = left if params.max_new_tokens is None else params.max_new_tokens
            if max_new > left:
                total = len(ids) + max_new
                raise RequestError(
                    "Requested token count exceeds the model's maximum context length of "
                    f"{self.server.context_length} tokens. You requested a total of {total} tokens: "
                    f"{len(ids)} tokens from the input messages and {max_new} tokens for the completion. "
                    "Please reduce the number of tokens "
                    "in the input messages or the completion to fit within the limit."
                )
            start = self._int_field(start_lens[index], "logprob_start_len", -1)
            start = len(ids) - 1 if start == -1 else min(start, len(ids) - 1)
            top_num = self._int_field(top_nums[index] or 0, "top_logprobs_num", 0)
            top_num = min(top_num, self.server.runner.vocab_size)
            wants_logprob = return_logprob[index]
            if wants_logprob is not None and not isinstance(wants_logprob, bool):
                raise RequestError(f"'return_logprob' must be true or false, got {show(wants_logprob)}")
            rid = rids[index]
            if rid is not None and not isinstance(rid, str):
                raise RequestError("'rid' must be a string or a list of strings")
            for sample in range(params.n):
                public_id = rid if rid is not None and params.n == 1 else uuid.uuid4().hex
                seqs.append(
                    Seq(
                        public_id=public_id,
                        rid=rid,
                        prompt_ids=ids,
                        params=params,
                        generator=self.server.scheduler.new_generator(params.sampling_seed, sample),
                        group=group,
                        index=len(seqs),
                        return_logprob=bool(wants_logprob),
                        logprob_start=start,
                        top_logprobs_num=top_num,
                        token_ids_logprob=token_ids[index],
                        position_token_ids=position_ids[index],
                        vision=visions[index],
                        max_new_tokens=max_new,
                        weight_version=self.server.weight_version,
                    )
                )
        group.seqs = seqs
        single = not batched and len(seqs) == 1
        return seqs, single, group
