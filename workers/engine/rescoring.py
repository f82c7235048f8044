"""The rescoring of `--rl-on-policy-target fsdp` (SGLang's flag): the logprobs a finished sequence reports for
its sampled tokens are recomputed by the trainer's own scoring function.

Owns `Rescorer`. Why: decoding scores token t from a KV cache in a [1, 1] forward, the trainer scores all of a
response at once in a [1, L] forward; different GEMM shapes add in different orders, so the two differ in the
last bits. Here each finished sequence (prompt + output) gets one forward of batch size 1, no padding, positions
0..L-1, through `workers.shared_torch.token_scores.token_scores` — the function the ranks call, on the same
positions (the response's), with the same chunk size — so with the same weights, dtype and thread count the
engine's logprobs are the trainer's bit for bit. The tokens themselves are still the ones decoding drew.
A vision-language sequence (docs/vlm.md) is scored as a rank scores a micro-batch of that one sample
(`workers.train_rank.vision.attach_vision`): its `pixel_values` / `image_grid_thw` passed to the forward, its
position ids transformers' packed multimodal [4, 1, L] (row 0 the text positions 0..L-1, rows 1-3 the model's
`get_rope_index`).

Invariant: it runs under the scheduler's model lock (in the worker thread of a step), never on released
weights, and it changes only logprobs, never tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from workers.engine.runner import ModelRunner, WeightsReleasedError
from workers.shared_torch.token_scores import token_scores
from workers.vlm_processor import PixelInputs, rope_positions


class Rescorer:
    def __init__(self, runner: ModelRunner, *, chunk_size: int | None = None) -> None:
        self.runner = runner
        self.chunk_size = chunk_size

    @torch.inference_mode()
    def score(self, prompt_ids: Sequence[int], output_ids: Sequence[int], vision: PixelInputs | None = None
              ) -> list[float]:
        """The logprob of each of `output_ids` after `prompt_ids` (at least one prompt token), with the
        sequence's images when it has some."""
        if not output_ids:
            return []
        if self.runner.weights_released:
            raise WeightsReleasedError("the weights are released; call /resume_memory_occupation first")
        tokens = [*prompt_ids, *output_ids]
        device = self.runner.device
        input_ids = torch.tensor([tokens], dtype=torch.long, device=device)
        positions = torch.arange(len(tokens), device=device).unsqueeze(0)
        start = len(prompt_ids) - 1  # position start scores the first output token
        scored = torch.zeros((1, len(tokens) - 1), dtype=torch.bool, device=device)
        scored[0, start:] = True
        images = None
        if vision is not None:
            processor = self.runner.vision_processor
            assert processor is not None, "a sequence with images on a text model"
            grid = vision.image_grid_thw.to(device)
            mrope, _ = rope_positions(self.runner.model, input_ids, grid, processor.image_token_id)
            positions = torch.cat([positions.view(1, 1, -1), mrope], dim=0)
            images = {"pixel_values": vision.pixel_values.to(device, torch.float32), "image_grid_thw": grid}
        log_probs, _ = token_scores(self.runner.model, input_ids=input_ids, position_ids=positions,
                                    chunk_size=self.chunk_size, with_entropy=False, scored=scored, vision=images)
        return log_probs[0, start:].tolist()

    def rescore(self, sequences: Sequence[tuple[Sequence[int], Sequence[int], PixelInputs | None]]
                ) -> list[list[float]]:
        """(prompt ids, output ids, images or None) of each finished sequence → its output logprobs."""
        return [self.score(prompt, output, vision) for prompt, output, vision in sequences]
