"""slime's `--custom-tis-function-path` on a training rank: a user's function in place of the built-in
truncated-importance-sampling weight (with `--use-tis`).

Owns the conversion between our `[B, T]` per-token tensors (packed or padded; each sample's response is a span
of the flattened layout) and slime's call, which is per sample:
`fn(args, *, pg_loss, train_log_probs, rollout_log_probs, loss_masks, total_lengths, response_lengths)`
with `pg_loss` the response tokens of every sample concatenated, the others lists of one 1-D tensor per sample
(its response tokens), returning `(pg_loss, loss_masks, metrics)`: the weighted loss in the same layout, the
masks it keeps (slime's rejection sampling drops tokens or samples by zeroing them) and metrics as tensors
over the same concatenated tokens. `args` is the hooks' args, built on the coordinator and sent at `init`.

Invariants: what comes back has the shapes that went in, or `TisHookError` names the function; the loss's
denominator stays the step's original loss tokens (as slime keeps its per-rollout totals), so a rejected token
lowers the loss sum without changing its scale; positions outside the responses are never touched.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from typing import Any

import torch

from workers.hook_loading import load_object


class TisHookError(ValueError):
    """The TIS hook returned something of the wrong shape or kind."""


class TisHook:
    def __init__(self, fn: Callable[..., Any], *, path: str, args: argparse.Namespace) -> None:
        self.fn = fn
        self.path = path
        self.args = args

    @classmethod
    def load(cls, path: str, hook_args: dict[str, Any] | None) -> TisHook:
        return cls(load_object(path, what="--custom-tis-function-path"), path=path,
                   args=argparse.Namespace(**(hook_args or {})))

    def __call__(self, *, pg_loss: torch.Tensor, train_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor,
                 loss_mask: torch.Tensor, spans: Sequence[tuple[int, int]], total_lengths: Sequence[int]
                 ) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
        """[B, T] tensors in, [B, T] loss and mask out, plus the metrics summed over the original loss tokens.
        `spans`: each sample's response as [start, end) of the flattened [B × T] layout."""
        rows = list(enumerate(spans))
        flat_pg, flat_train = pg_loss.reshape(-1), train_log_probs.reshape(-1)
        flat_rollout, flat_loss_mask = rollout_log_probs.reshape(-1), loss_mask.reshape(-1)
        flat_mask = torch.cat([flat_loss_mask[start:end] for start, end in spans])
        result = self.fn(
            self.args,
            pg_loss=torch.cat([flat_pg[start:end] for start, end in spans]),
            train_log_probs=[flat_train[start:end] for start, end in spans],
            rollout_log_probs=[flat_rollout[start:end] for start, end in spans],
            loss_masks=[flat_loss_mask[start:end] for start, end in spans],
            total_lengths=list(total_lengths),
            response_lengths=[end - start for start, end in spans],
        )
        where = f"--custom-tis-function-path {self.path!r}"
        if not isinstance(result, tuple | list) or len(result) != 3:
            raise TisHookError(f"{where} returned {type(result).__name__}; expected (pg_loss, loss_masks, metrics)")
        flat_loss, masks, metrics = result
        if not isinstance(flat_loss, torch.Tensor) or flat_loss.shape != flat_mask.shape:
            raise TisHookError(f"{where} returned a pg_loss of shape {getattr(flat_loss, 'shape', None)}; expected "
                               f"{tuple(flat_mask.shape)} (every sample's response tokens, concatenated)")
        if not isinstance(masks, list | tuple) or len(masks) != len(rows):
            raise TisHookError(f"{where} returned {type(masks).__name__} loss_masks; expected one per sample "
                               f"({len(rows)})")
        weighted, kept = flat_pg.clone(), flat_loss_mask.clone()
        offset = 0
        for (row, (start, end)), mask in zip(rows, masks, strict=True):
            if not isinstance(mask, torch.Tensor) or mask.shape != (end - start,):
                raise TisHookError(f"{where} returned a loss mask of shape {getattr(mask, 'shape', None)} for "
                                   f"sample {row}; expected ({end - start},)")
            weighted[start:end] = flat_loss[offset : offset + end - start]
            kept[start:end] = mask.to(kept.dtype)
            offset += end - start
        return weighted.view_as(pg_loss), kept.view_as(loss_mask), self._metrics(metrics, flat_mask, where)

    @staticmethod
    def _metrics(metrics: Any, flat_mask: torch.Tensor, where: str) -> dict[str, float]:
        if not isinstance(metrics, dict):
            raise TisHookError(f"{where} returned {type(metrics).__name__} metrics; expected a dict of tensors")
        sums = {}
        for key, value in metrics.items():
            value = torch.as_tensor(value).detach().float().reshape(-1)
            if value.numel() == flat_mask.numel():
                sums[f"tis_hook/{key}"] = float((value * flat_mask).sum())
            elif value.numel() == 1:  # one number for the micro-batch: counted once per loss token
                sums[f"tis_hook/{key}"] = float(value) * float(flat_mask.sum())
        return sums
