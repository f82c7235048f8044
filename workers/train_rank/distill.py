"""On-policy distillation on the rank: the reverse-KL term of slime's `apply_opd_kl_to_advantages`.

Owns `teacher_tensor` (the samples' `teacher_log_probs` laid out as a
micro-batch's per-token tensors), `reverse_kl_tensor` (the same for miles' top-k OPD, whose per-token reverse KL
— a weighted sum over each position's top-k tokens — comes computed with the sample) and `Distiller`, which turns a micro-batch's advantages into
`A - kl_coef * (student - teacher)` per token, slime's and miles' formula, where `student` is the logprob the PPO
ratio is taken against (the trainer's own recomputed logprobs, or the engine's with `--use-rollout-logprobs`) and
`teacher` comes with the sample (`sglang`) or from the frozen teacher model on this rank (`megatron`, loaded as
the reference model is).

Invariants: the term carries no gradient (the student logprobs are detached, as slime's are computed before the
update); tokens outside the loss mask get no term and count in no metric; the metric `opd_reverse_kl` is the sum
of `student - teacher` over loss tokens (the coordinator divides by the step's loss tokens: a token mean).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from workers.protocol.arrays import Kind, as_numpy
from workers.protocol.train_settings import OpdSettings

METRIC = "opd_reverse_kl"  # slime's and miles' name


class DistillError(ValueError):
    """A sample lacks the teacher logprobs distillation needs."""


def teacher_tensor(samples: Sequence[Any], spans: Sequence[tuple[int, int]], shape: torch.Size) -> torch.Tensor:
    """The samples' `teacher_log_probs` in a micro-batch's per-token layout (`spans`: each sample's response in
    the flattened layout, in sample order); 0 outside responses. DistillError for a sample without them."""
    return _per_token(samples, spans, shape, "teacher_log_probs", "on-policy distillation (--opd-type sglang) needs "
                      "the teacher's logprob of each (asked during the rollout, or kept in the replayed dump)")


def reverse_kl_tensor(samples: Sequence[Any], spans: Sequence[tuple[int, int]], shape: torch.Size) -> torch.Tensor:
    """miles' top-k OPD: the samples' precomputed `opd_reverse_kl` in the micro-batch's per-token layout."""
    return _per_token(samples, spans, shape, "opd_reverse_kl", "top-k on-policy distillation "
                      "(--opd-log-prob-top-k) needs the weighted reverse KL of each (computed during the rollout, "
                      "or kept in the replayed dump)")


def _per_token(samples: Sequence[Any], spans: Sequence[tuple[int, int]], shape: torch.Size, name: str,
               why: str) -> torch.Tensor:
    flat = torch.zeros(int(torch.Size(shape).numel()), dtype=torch.float32)
    for index, (sample, (start, end)) in enumerate(zip(samples, spans, strict=True)):
        values = getattr(sample, name)
        if values is None or len(values) != end - start:
            count = "no" if values is None else len(values)
            raise DistillError(f"sample {index} of the micro-batch has {count} {name} for {end - start} "
                               f"response tokens: {why}")
        if end > start:  # a packed array (the wire's float64, rounded as the lists were) or a list
            flat[start:end] = torch.from_numpy(as_numpy(Kind.FLOATS, values).astype(np.float32))
    return flat.view(shape)


class Distiller:
    """The reverse-KL term for one rank: `teacher` is the frozen teacher model (`megatron`) or None (`sglang`)."""

    def __init__(self, spec: OpdSettings, teacher: Any = None) -> None:
        self.spec, self.teacher = spec, teacher

    def advantages(self, *, advantages: torch.Tensor, student_log_probs: torch.Tensor | None,
                   teacher_log_probs: torch.Tensor | None, loss_mask: torch.Tensor,
                   reverse_kl: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
        """(advantages with the term, {METRIC: sum of the reverse KL over loss tokens}). With top-k OPD the
        reverse KL comes precomputed (`reverse_kl`, miles' `opd_reverse_kl`), else it is student - teacher."""
        if reverse_kl is None:
            assert student_log_probs is not None and teacher_log_probs is not None
            reverse_kl = student_log_probs.detach().float() - teacher_log_probs.float()
        reverse_kl = reverse_kl.detach().float() * loss_mask
        shaped = advantages - self.spec.kl_coef * reverse_kl
        return shaped, {METRIC: float(reverse_kl.sum())}
