"""The rescoring of `--rl-on-policy-target fsdp` (SGLang's flag): the logprobs a finished sequence reports for
its sampled tokens are recomputed by the trainer's own scoring function.

Owns `Rescorer`. Why: decoding scores token t from a KV cache in a [1, 1] forward, the trainer scores all of a
response at once in a [1, L] forward; different GEMM shapes add in different orders, so the two differ in the
last bits. Here each finished sequence (prompt + output) gets one forward of batch size 1, no padding, positions
0..L-1, through `workers.shared_torch.token_scores.token_scores` — the function the ranks call, on the same
positions (the response's), with the same chunk size — so with the same weights, dtype and thread count the
engine's logprobs are the trainer's bit for bit. The tokens themselves are still the ones decoding drew.

Invariant: it runs under the scheduler's model lock (in the worker thread of a step), never on released
weights, and it changes only logprobs, never tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from workers.engine.runner import ModelRunner, WeightsReleasedError
from workers.shared_torch.token_scores import token_scores


class Rescorer:
    def __init__(self, runner: ModelRunner, *, chunk_size: int | None = None) -> None:
        self.runner = runner
        self.chunk_size = chunk_size

    @torch.inference_mode()
    def score(self, prompt_ids: Sequence[int], output_ids: Sequence[int]) -> list[float]:
        """The logprob of each of `output_ids` after `prompt_ids` (at least one prompt token)."""
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
        log_probs, _ = token_scores(self.runner.model, input_ids=input_ids, position_ids=positions,
                                    chunk_size=self.chunk_size, with_entropy=False, scored=scored)
        return log_probs[0, start:].tolist()

    def rescore(self, sequences: Sequence[tuple[Sequence[int], Sequence[int]]]) -> list[list[float]]:
        return [self.score(prompt, output) for prompt, output in sequences]
