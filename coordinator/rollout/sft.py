"""The SFT rollout: chats from `--prompt-data` become training samples, with no engine (slime's
`slime.rollout.sft_rollout.generate_rollout`, which it aliases).

Owns `SftRollout`, the rollout fn of `--loss-type sft_loss` runs: each call takes `--rollout-batch-size` chats
(`--input-key`, `messages` in slime's scripts; tools from the record's metadata `tools`, as slime) from the data
source, in epochs, and tokenizes each with the tokenizer's chat template under `--loss-mask-type`
(`coordinator.rollout.sft_mask`). A sample's response is slime's: from the first trained token to the end, the
loss mask over it; reward 0, rollout logprobs 0 (nothing was sampled). The chat template is applied here whatever
`--apply-chat-template` says (slime's SFT scripts pass it or not alike); the tokenizer loads once, in a worker
thread, with the first rollout. Invariant: every sample has at least one trained token, or the rollout fails
naming the record.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import anyio.to_thread

from coordinator.data.source import DataSourceError, PromptRecord
from coordinator.rollout.sft_mask import ChatLossMask, LossMaskError, response_length
from replay.sample import RolloutBatch, Sample, SampleStatus

if TYPE_CHECKING:
    from coordinator.rollout.context import RolloutContext
    from workers.vlm_processor import VlmProcessor


class SftRollout:
    def __init__(self, context: RolloutContext) -> None:
        self.context = context
        self.config = context.config
        self._mask: ChatLossMask | None = None
        self._vision: VlmProcessor | None = None  # loaded with the first chat holding images

    def _load_mask(self) -> ChatLossMask:
        tokenizer = self.context.tokenizer
        if tokenizer is None:  # an SFT run starts no engines, so the run loaded no tokenizer
            from coordinator.data.tokenizer import load_tokenizer

            tokenizer = load_tokenizer(self.config.rollout.hf_checkpoint)
        return ChatLossMask(tokenizer, self.config.sft.loss_mask_type)

    async def __call__(self, rollout_id: int, weight_version: str) -> RolloutBatch:
        if self._mask is None:
            self._mask = await anyio.to_thread.run_sync(self._load_mask)
        records = self.context.data_source.take(self.config.rollout.rollout_batch_size or 0)
        samples = await anyio.to_thread.run_sync(self._samples, records)
        trained = sum(sum(sample.loss_mask) for sample in samples)
        return RolloutBatch(rollout_id=rollout_id, groups=[[sample] for sample in samples],
                            metrics={"sft/trained_tokens": float(trained),
                                     "sft/tokens": float(sum(len(sample.tokens) for sample in samples))})

    def _samples(self, records: list[PromptRecord]) -> list[Sample]:
        assert self._mask is not None
        input_key = self.config.rollout.input_key
        samples = []
        for index, record in enumerate(records):
            where = f"--prompt-data record {record.index} (--input-key {input_key!r})"
            if not isinstance(record.prompt, list):
                raise DataSourceError(f"{where}: the SFT rollout trains on chats (a list of messages), got "
                                      f"{type(record.prompt).__name__}")
            tools = record.metadata.get("tools")
            try:
                token_ids, loss_mask = self._mask(record.prompt, tools=tools)
            except LossMaskError as error:
                raise LossMaskError(f"{where}: {error}") from None
            train_inputs = None
            if record.images:  # slime's VLM SFT: the images' placeholders expanded, their tokens untrained
                if self._vision is None:
                    from workers.vlm_processor import VlmProcessor

                    self._vision = VlmProcessor(str(self.config.rollout.hf_checkpoint))
                pixels = self._vision.pixel_inputs(record.images)
                token_ids, loss_mask = self._vision.expand_with_mask(token_ids, loss_mask, pixels.image_grid_thw)
                loss_mask = [0 if token == self._vision.image_token_id else value
                             for token, value in zip(token_ids, loss_mask, strict=True)]
                train_inputs = {"pixel_values": pixels.pixel_values, "image_grid_thw": pixels.image_grid_thw}
            length = response_length(loss_mask)
            if length == 0:
                raise DataSourceError(f"{where}: the chat has no assistant tokens to train on (no assistant "
                                      "message, or every one has step_loss_mask 0)")
            samples.append(Sample(
                group_index=index, sample_index=0, index=index, prompt=record.prompt, tokens=token_ids,
                response_length=length, loss_mask=loss_mask[-length:], rollout_log_probs=[0.0] * length,
                reward=0.0, status=SampleStatus.COMPLETED, label=record.label,
                metadata={**record.metadata, "prompt_index": record.index}, multimodal_train_inputs=train_inputs))
        return samples

