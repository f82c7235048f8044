"""One slime/miles sample dict → a validated rayless `Sample`: slime's fields mapped, nothing invented.

Owns the mapping of slime's sample fields (docs/replay.md lists them) and what the conversion records in the
sample's metadata (filled log-probs, slime's `failed` status, chat prompts, JSON labels, unmapped keys).
Invariants: only plain data comes out (tensors become lists, anything else is a `SampleError`); missing
log-probs are never invented unless asked for, and then flagged; the result passes `Sample.validate()`.
"""

from __future__ import annotations

import json
from array import array
from typing import Any

from replay.sample import Sample, SampleError, SampleStatus

_KNOWN_KEYS = {
    "index",
    "group_index",
    "sample_index",
    "prompt",
    "tokens",
    "response",
    "response_length",
    "label",
    "reward",
    "loss_mask",
    "rollout_log_probs",
    "status",
    "metadata",
    "weight_versions",
    "advantage",
}
_STATUS_ALIASES = {s.value: s for s in SampleStatus} | {"failed": SampleStatus.ABORTED}


def plain(value: Any, where: str) -> Any:
    """Tensors → lists/scalars, recursively; raises SampleError on anything that is not plain data."""
    if value is None or type(value) in (bool, int, float, str, bytes):
        return value
    if isinstance(value, dict):
        return {k: plain(v, where) for k, v in value.items()}
    if isinstance(value, list):
        return [plain(v, where) for v in value]
    if isinstance(value, tuple):
        return tuple(plain(v, where) for v in value)
    if isinstance(value, (set, frozenset)):
        return sorted((plain(v, where) for v in value), key=repr)
    if hasattr(value, "tolist") and type(value).__module__.startswith("torch"):
        return value.tolist()
    raise SampleError(f"{where}: cannot convert a {type(value).__name__}")


def _numbers(value: Any, typecode: str, where: str, name: str) -> list[Any]:
    """A list/tensor of numbers as Python ints ('q') or floats ('d'), converted in C, not per element."""
    if not isinstance(value, list):
        value = _as_list(value, where, name)
    try:
        return array(typecode, value).tolist()
    except (TypeError, OverflowError):
        kind = "64-bit integers" if typecode == "q" else "numbers"
        raise SampleError(f"{where}: {name} must hold {kind}, got {value[:4]!r:.80}...") from None


def _as_list(value: Any, where: str, name: str) -> list[Any]:
    value = plain(value, where)
    if not isinstance(value, list):
        raise SampleError(f"{where}: {name} must be a list or a 1-d tensor, got {type(value).__name__}")
    return value


def _reward(value: Any, where: str) -> float | dict[str, float] | None:
    value = plain(value, where)
    if value is None or isinstance(value, dict):
        if isinstance(value, dict):
            try:
                return {str(k): float(v) for k, v in value.items()}
            except (TypeError, ValueError):
                raise SampleError(f"{where}: reward dict {value!r:.80} has non-numeric values") from None
        return value
    if isinstance(value, (bool, int, float)):
        return float(value)
    if isinstance(value, list) and len(value) == 1:
        return float(value[0])
    raise SampleError(f"{where}: reward {value!r:.80} is neither a number, a dict nor None")


def convert_sample(
    raw: Any,
    position: int,
    *,
    n_samples_per_prompt: int | None = None,
    allow_missing_logprobs: bool = False,
) -> Sample:
    """One slime/miles sample dict → a validated rayless Sample (SampleError says what is missing)."""
    where = f"sample #{position}"
    if not isinstance(raw, dict):
        raise SampleError(f"{where}: expected a dict, got {type(raw).__name__}")
    notes: dict[str, Any] = {}  # what the conversion did (filled, mapped), kept in the sample's metadata
    tokens, response_length, loss_mask, logprobs = _token_arrays(
        raw, where, notes, allow_missing_logprobs=allow_missing_logprobs
    )
    index, group_index, sample_index = _indices(raw, where, position, n_samples_per_prompt)
    status = _status(raw, where, notes)
    prompt = _prompt(raw, where, notes)
    label = _label(raw, where, notes)
    response = plain(raw.get("response", ""), where)
    if not isinstance(response, str):
        raise SampleError(f"{where}: response must be a str, got {type(response).__name__}")
    weight_versions = [str(v) for v in _as_list(raw.get("weight_versions") or [], where, "weight_versions")]
    advantage = plain(raw.get("advantage", 0.0), where)
    advantage = float(advantage) if isinstance(advantage, (int, float)) else 0.0
    metadata = _metadata(raw, where, index, notes)
    sample = Sample(
        group_index=group_index,
        sample_index=sample_index,
        prompt=prompt,
        tokens=tokens,
        response_length=response_length,
        loss_mask=loss_mask,
        rollout_log_probs=logprobs,
        reward=_reward(raw.get("reward"), where),
        status=status,
        weight_versions=weight_versions,
        label=label,
        response=response,
        advantage=advantage,
        metadata=metadata,
    )
    sample.validate()
    return sample


def _token_arrays(
    raw: dict[Any, Any], where: str, notes: dict[str, Any], *, allow_missing_logprobs: bool
) -> tuple[list[int], int, list[int], list[float]]:
    """tokens, response_length, loss_mask (all ones when absent) and rollout_log_probs (zeros, noted in
    `notes`, only when `allow_missing_logprobs`)."""
    tokens = _numbers(raw.get("tokens"), "q", where, "tokens") if "tokens" in raw else None
    if tokens is None:
        raise SampleError(f"{where}: has no 'tokens'")
    response_length = plain(raw.get("response_length"), where)
    if not isinstance(response_length, int):
        raise SampleError(f"{where}: 'response_length' must be an int, got {response_length!r:.40}")
    loss_mask_raw = raw.get("loss_mask")
    loss_mask = (
        [1] * response_length if loss_mask_raw is None else _numbers(loss_mask_raw, "q", where, "loss_mask")
    )
    logprobs_raw = raw.get("rollout_log_probs")
    if logprobs_raw is None:
        if not allow_missing_logprobs:
            raise SampleError(
                f"{where}: has no rollout_log_probs; the PPO ratio would be computed against invented "
                "values. Pass --allow-missing-logprobs to fill zeros (flagged in metadata) anyway."
            )
        logprobs = [0.0] * response_length
        notes["rollout_log_probs_missing"] = True
    else:
        logprobs = _numbers(logprobs_raw, "d", where, "rollout_log_probs")
    return tokens, response_length, loss_mask, logprobs


def _indices(
    raw: dict[Any, Any], where: str, position: int, n_samples_per_prompt: int | None
) -> tuple[Any, int, int]:
    """slime's `index` as given, and the group and sample indices (derived from `index` when absent)."""
    index = plain(raw.get("index"), where)
    group_index = plain(raw.get("group_index"), where)
    if not isinstance(group_index, int):
        if isinstance(index, int) and n_samples_per_prompt:
            group_index = index // n_samples_per_prompt
        else:
            raise SampleError(
                f"{where}: has no group_index; pass --n-samples-per-prompt so it can be derived from 'index'"
            )
    sample_index = plain(raw.get("sample_index"), where)
    if not isinstance(sample_index, int):
        sample_index = index if isinstance(index, int) else position
    return index, group_index, sample_index


def _status(raw: dict[Any, Any], where: str, notes: dict[str, Any]) -> SampleStatus:
    """slime's status (an enum or its name, any case); slime's `failed` is noted, as our statuses lack it."""
    status_raw = plain(raw.get("status", "completed"), where)
    status_value = getattr(status_raw, "value", status_raw)
    if isinstance(status_value, str):
        status_value = status_value.lower().removeprefix("status.")
    status = _STATUS_ALIASES.get(status_value) if isinstance(status_value, str) else None
    if status is None:
        raise SampleError(f"{where}: unknown status {status_raw!r:.40}")
    if status_value == "failed":
        notes["slime_status"] = "failed"
    return status


def _prompt(raw: dict[Any, Any], where: str, notes: dict[str, Any]) -> str:
    """The prompt as text; a list of chat messages is kept whole in `notes` and joined as `role: content`."""
    prompt = plain(raw.get("prompt", ""), where)
    if isinstance(prompt, list):
        notes["prompt_messages"] = prompt
        prompt = "\n".join(
            f"{m.get('role', '?')}: {m.get('content', '')}" if isinstance(m, dict) else str(m) for m in prompt
        )
    elif not isinstance(prompt, str):
        raise SampleError(f"{where}: prompt must be a str or a list of messages, got {type(prompt).__name__}")
    return prompt


def _label(raw: dict[Any, Any], where: str, notes: dict[str, Any]) -> str | None:
    """The label as text: a non-str label becomes its JSON, noted in `notes`."""
    label = plain(raw.get("label"), where)
    if label is not None and not isinstance(label, str):
        label = json.dumps(label, sort_keys=True, default=str)
        notes["label_is_json"] = True
    return label


def _metadata(raw: dict[Any, Any], where: str, index: Any, notes: dict[str, Any]) -> dict[str, Any]:
    """The source's metadata, then the conversion's `notes`, then every key we do not map (under `slime`,
    with slime's `index`) and the names of those that are not plain data (`slime_dropped`)."""
    source_metadata = plain(raw.get("metadata") or {}, where)
    if not isinstance(source_metadata, dict):
        source_metadata = {"value": source_metadata}
    metadata = {**source_metadata, **notes}
    extra: dict[str, Any] = {}
    dropped: list[str] = []
    for key, value in raw.items():
        if key in _KNOWN_KEYS:
            continue
        try:
            extra[str(key)] = plain(value, where)
        except SampleError:
            dropped.append(str(key))
    if isinstance(index, int):
        extra["index"] = index
    if extra:
        metadata["slime"] = extra
    if dropped:
        metadata["slime_dropped"] = dropped
    return metadata
