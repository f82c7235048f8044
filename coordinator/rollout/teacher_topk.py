"""miles' top-k on-policy distillation (`--opd-log-prob-top-k K`): the per-token reverse-KL estimate of
"Rethinking On-Policy Distillation", computed during the rollout from the engines' top-k logprobs.

Owns the token set of each response position (`--opd-top-k-strategy`: the student's top-k, the teacher's, their
intersection, union or symmetric difference), the weights (`--opd-reward-weight-mode`: the student's or the
teacher's probability, softmax-normalised over the set — unnormalised for `xor`, as miles — or uniform), the
requests that fetch what a strategy needs (the teacher's top-k and its logprobs of the student's top-k ids with
SGLang's `top_logprobs_num` / `token_ids_logprob`; the student engine's logprobs of the teacher's top-k ids),
and the estimate itself: at each response position, sum over the set of w × (student − teacher logprob).

Invariants: the estimate has one finite float per response token, or `TopKError` names what the answers lacked;
a token's logprob is looked up in the side's own top-k first, then in what that side was asked of the other's
ids (miles' `_lookup_logprob`), and a token found in neither is an error, never a guess.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from coordinator.config.distill import REWARD_WEIGHT_MODES as WEIGHT_MODES
from coordinator.config.distill import STUDENT_ON_TEACHER as STUDENT_ON_TEACHER
from coordinator.config.distill import TEACHER_ON_STUDENT as TEACHER_ON_STUDENT
from coordinator.config.distill import TEACHER_TOP as TEACHER_TOP
from coordinator.config.distill import TopK as TopK
from workers.errors import RaylessError

#: sample.metadata key of the student's top-k [logprob, id, text] per response token (miles' name)
STUDENT_TOP_KEY = "opd_student_top_logprobs"

LogprobMap = dict[int, float]


class TopKError(RaylessError, ValueError):
    """An answer lacks the top-k or asked-id logprobs the strategy needs."""


def entries_to_map(entries: Iterable[Any] | None) -> LogprobMap:
    """SGLang's [logprob, id, text] entries of one position as id → logprob, in their order."""
    return {int(entry[1]): float(entry[0]) for entry in entries or () if entry is not None}


def unique_ids(positions: Iterable[Iterable[Any] | None]) -> list[int]:
    """The sorted ids that appear in any position's entries."""
    return sorted({int(entry[1]) for entries in positions for entry in entries or () if entry is not None})


def selected_ids(strategy: str, student_ids: Sequence[int], teacher_ids: Sequence[int]) -> list[int]:
    """One position's token set, in miles' order (student's first, then the teacher's)."""
    student_set, teacher_set = set(student_ids), set(teacher_ids)
    if strategy == "only-student":
        return list(student_ids)
    if strategy == "only-teacher":
        return list(teacher_ids)
    if strategy == "intersection":
        return [token for token in student_ids if token in teacher_set]
    if strategy == "union":
        return list(dict.fromkeys([*student_ids, *teacher_ids]))
    if strategy == "xor":
        return [token for token in [*student_ids, *teacher_ids] if (token in student_set) != (token in teacher_set)]
    raise ValueError(f"unknown top-k OPD strategy {strategy!r}")


def weights(student: Sequence[float], teacher: Sequence[float], mode: str, *, normalize: bool) -> list[float]:
    """Each selected token's weight: exp of the chosen side's logprob (0 for `none`), softmax-normalised over
    the set when `normalize` (max-shifted, as miles)."""
    if mode not in WEIGHT_MODES:
        raise ValueError(f"unknown top-k OPD weight mode {mode!r}")
    if not student:
        return []
    logps = list(student) if mode == "student_p" else list(teacher) if mode == "teacher_p" else [0.0] * len(student)
    if not normalize:
        return [math.exp(value) for value in logps]
    top = max(logps)
    shifted = [math.exp(value - top) for value in logps]
    total = sum(shifted)
    return [value / total for value in shifted] if total > 0 else [0.0] * len(logps)


def _lookup(token: int, own: LogprobMap, asked: LogprobMap, side: str, position: int) -> float:
    if token in own:
        return own[token]
    if token in asked:
        return asked[token]
    raise TopKError(f"response position {position}: no {side} logprob for token id {token}")


def reverse_kl(spec: TopK, *, student_top: Sequence[LogprobMap], teacher_top: Sequence[LogprobMap],
               teacher_on_student: Sequence[LogprobMap], student_on_teacher: Sequence[LogprobMap]) -> list[float]:
    """The per-response-token estimate: at each position, sum over the strategy's set of
    weight × (student − teacher logprob). Each argument holds one map per response position ({} where the
    strategy does not read it)."""
    out = []
    for position, (s_top, t_top, t_asked, s_asked) in enumerate(
            zip(student_top, teacher_top, teacher_on_student, student_on_teacher, strict=True)):
        ids = selected_ids(spec.strategy, list(s_top), list(t_top))
        student = [_lookup(token, s_top, s_asked, "student", position) for token in ids]
        teacher = [_lookup(token, t_top, t_asked, "teacher", position) for token in ids]
        w = weights(student, teacher, spec.weight_mode, normalize=spec.strategy != "xor")
        value = sum(wi * (s - t) for wi, s, t in zip(w, student, teacher, strict=True))
        if not math.isfinite(value):
            raise TopKError(f"response position {position}: the reverse-KL estimate {value} is not finite")
        out.append(float(value))
    return out


def asked_ids(spec: TopK, tokens: Sequence[int], prompt_length: int, positions: Sequence[Iterable[Any] | None]
              ) -> dict[str, Any]:
    """The request fields that ask one side for its logprobs of the other side's top-k ids (`positions`: the
    entries of each response position): the sorted union at every position (`token_ids_logprob`), or with
    per-position scoring each position's own ids (`token_ids_logprob_positions`, one list per input position
    from position 0, the prompt's empty)."""
    if not spec.per_position:
        return {"token_ids_logprob": unique_ids(positions)}
    own = [[int(entry[1]) for entry in entries or () if entry is not None] for entries in positions]
    return {"token_ids_logprob_positions": [[] for _ in range(prompt_length)] + own[: len(tokens) - prompt_length]}


def score_payload(tokens: Sequence[int], prompt_length: int, *, top: int = 0,
                  asked: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """A prefill-only request for the input logprobs from the prompt's last token on: with `top`, each
    position's top-k (`top_logprobs_num`); with `asked` (`asked_ids`), the other side's ids' logprobs."""
    payload: dict[str, Any] = {
        "input_ids": [int(token) for token in tokens],
        "sampling_params": {"temperature": 1.0, "max_new_tokens": 0, "skip_special_tokens": False},
        "return_logprob": True,
        "logprob_start_len": max(prompt_length - 1, 0),
    }
    if top > 0:
        payload["top_logprobs_num"] = top
    payload.update(asked or {})
    return payload


def response_maps(answer: Any, field: str, response_length: int, where: str) -> list[LogprobMap]:
    """The last `response_length` positions of `meta_info[field]` (one per response token) as maps."""
    meta = answer.get("meta_info") if isinstance(answer, Mapping) else None
    entries = meta.get(field) if isinstance(meta, Mapping) else None
    if not isinstance(entries, list) or len(entries) < response_length:
        count = len(entries) if isinstance(entries, list) else "no"
        raise TopKError(f"{where}: the answer has {count} meta_info.{field} positions, the response has "
                        f"{response_length} tokens")
    return [entries_to_map(item) for item in entries[len(entries) - response_length:]]


def student_top_logprobs(metadata: Mapping[str, Any], response_length: int, where: str) -> list[Any]:
    """The student's top-k entries of each response token, kept by the rollout in the sample's metadata."""
    tops = metadata.get(STUDENT_TOP_KEY)
    if not isinstance(tops, list) or len(tops) < response_length:
        count = len(tops) if isinstance(tops, list) else "no"
        raise TopKError(f"{where}: {count} student top-k logprobs (metadata[{STUDENT_TOP_KEY!r}]) for "
                        f"{response_length} response tokens; the rollout asks the engines for them with "
                        "--opd-log-prob-top-k (a custom generate function must keep them itself)")
    return tops[len(tops) - response_length:]
