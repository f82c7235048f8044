"""On-policy distillation on the rank: the reverse-KL term of slime's `apply_opd_kl_to_advantages`.

Owns `OpdSpec` (the ranks' `opd` setting), `teacher_tensor` (the samples' `teacher_log_probs` laid out as a
micro-batch's per-token tensors) and `Distiller`, which turns a micro-batch's advantages into
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
from dataclasses import dataclass
from typing import Any

import torch

OPD_TYPES = ("sglang", "megatron")
METRIC = "opd_reverse_kl"  # slime's and miles' name


class DistillError(ValueError):
    """The `opd` setting is malformed, or a sample lacks the teacher logprobs distillation needs."""


@dataclass(frozen=True)
class OpdSpec:
    type: str
    kl_coef: float = 1.0
    #: the teacher model of `megatron` (a Hugging Face directory or a rayless checkpoint)
    teacher_path: str | None = None

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> OpdSpec:
        unknown = sorted(set(raw) - {"type", "kl_coef", "teacher_path"})
        if unknown:
            raise DistillError(f"opd: unknown keys {unknown}")
        spec = cls(type=str(raw.get("type")), kl_coef=float(raw.get("kl_coef", 1.0)),
                   teacher_path=raw.get("teacher_path"))
        if spec.type not in OPD_TYPES:
            raise DistillError(f"opd: type {spec.type!r} is not one of {OPD_TYPES}")
        if spec.type == "megatron" and not spec.teacher_path:
            raise DistillError("opd: type 'megatron' needs teacher_path (the teacher model the rank loads)")
        return spec


def teacher_tensor(samples: Sequence[Any], spans: Sequence[tuple[int, int]], shape: torch.Size) -> torch.Tensor:
    """The samples' `teacher_log_probs` in a micro-batch's per-token layout (`spans`: each sample's response in
    the flattened layout, in sample order); 0 outside responses. DistillError for a sample without them."""
    flat = torch.zeros(int(torch.Size(shape).numel()), dtype=torch.float32)
    for index, (sample, (start, end)) in enumerate(zip(samples, spans, strict=True)):
        values = sample.teacher_log_probs
        if values is None or len(values) != end - start:
            count = "no" if values is None else len(values)
            raise DistillError(f"sample {index} of the micro-batch has {count} teacher_log_probs for {end - start} "
                               "response tokens: on-policy distillation (--opd-type sglang) needs the teacher's "
                               "logprob of each (asked during the rollout, or kept in the replayed dump)")
        if end > start:
            flat[start:end] = torch.tensor(values, dtype=torch.float32)
    return flat.view(shape)


class Distiller:
    """The reverse-KL term for one rank: `teacher` is the frozen teacher model (`megatron`) or None (`sglang`)."""

    def __init__(self, spec: OpdSpec, teacher: Any = None) -> None:
        self.spec, self.teacher = spec, teacher

    def advantages(self, *, advantages: torch.Tensor, student_log_probs: torch.Tensor,
                   teacher_log_probs: torch.Tensor, loss_mask: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        """(advantages with the term, {METRIC: sum of the reverse KL over loss tokens})."""
        reverse_kl = (student_log_probs.detach().float() - teacher_log_probs.float()) * loss_mask
        shaped = advantages - self.spec.kl_coef * reverse_kl
        return shaped, {METRIC: float(reverse_kl.sum())}
