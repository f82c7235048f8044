"""The batch-invariant model runner of `--enable-deterministic-inference` (SGLang's flag, our mechanism).

Owns `BatchInvariantRunner`: the model runner whose decode step runs every cached sequence through the model
alone — its own cache columns (its padding cut off), no attention mask, batch size 1 — and puts the grown cache
back in the batch layout. A prefill already runs alone. Invariant: the logits a sequence gets at each step are a
function of its own tokens and the weights only, never of which other sequences share the batch, how long they
are, or when they joined; so with a per-request `sampling_seed` a request draws the same tokens under any load.
Cost: one forward per running sequence per step instead of one per step (memory as the batched runner's).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from workers.engine.runner import ModelRunner


class BatchInvariantRunner(ModelRunner):
    def _decode(self) -> torch.Tensor:
        length = self._kv[0][0].shape[2]
        rows_logits: list[torch.Tensor] = []
        grown: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = [([], []) for _ in self._kv]
        for index, row in enumerate(self.rows):
            pad = int(self._pad[index])
            own = [(keys[index : index + 1, :, pad:], values[index : index + 1, :, pad:]) for keys, values in self._kv]
            cache = self._new_cache(own)
            tokens = self._tensor([[self._last_token[row]]])
            # the row's own token count (plus a VLM row's multimodal rope delta)
            positions = self._tensor([[length - pad + self._rope_delta.get(row, 0)]])
            rows_logits.append(self._forward(tokens, positions, None, cache)[:, -1, :])
            for layer, (keys, values) in enumerate(self._cache_tensors(cache)):
                grown[layer][0].append(F.pad(keys, (0, 0, pad, 0)))
                grown[layer][1].append(F.pad(values, (0, 0, pad, 0)))
        self._kv = [(torch.cat(keys), torch.cat(values)) for keys, values in grown]
        return torch.cat(rows_logits)
