"""Sampling parameters of one /generate item, and the batched sampler the model runner calls every step.

Owns two things:
- `parse_sampling_params`: turns a request's `sampling_params` dict into a validated, frozen `SamplingParams`
  with SGLang's defaults and range rules. Every rejection is a `RequestError` (the server answers 400 with its
  message); nothing here raises a TypeError on odd input.
- `sample_rows`: picks the next token for every row of a logits matrix, each row with its own temperature,
  top-k, top-p, min-p, banned ids and random generator.

Invariant: the logprob returned for a sampled token is `log_softmax(raw float32 logits)[token]` — taken before
temperature, top-k/top-p/min-p and the `min_new_tokens` ban. This is what SGLang returns by default (it only
returns post-temperature logprobs behind a non-default server flag), and it is what training compares
rollout logprobs against. A row's draws depend only on its own generator, so a request with a
`sampling_seed` samples the same tokens whatever else is in the batch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch


class RequestError(ValueError):
    """Input the server rejects with 400 and this message."""


# Keys SGLang's SamplingParams accepts that this engine ignores because they do not change its output.
_IGNORED_KEYS = {"spaces_between_special_tokens", "stream_interval", "custom_params"}
# Keys SGLang accepts whose non-default values this engine cannot honour: rejected unless left at default.
_UNSUPPORTED_DEFAULTS: dict[str, Any] = {
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "regex": None,
    "json_schema": None,
    "ebnf": None,
    "structural_tag": None,
    "logit_bias": None,
    "lora_path": None,
}
_KNOWN_KEYS = {
    "max_new_tokens",
    "min_new_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "skip_special_tokens",
    "no_stop_trim",
    "n",
    "sampling_seed",
    *_IGNORED_KEYS,
    *_UNSUPPORTED_DEFAULTS,
}


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    stop: tuple[str, ...] = ()
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    n: int = 1
    sampling_seed: int | None = None


def _number(params: dict[str, Any], key: str, default: float) -> float:
    value = params.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise RequestError(f"sampling_params.{key} must be a finite number, got {value!r}")
    return float(value)


def _integer(params: dict[str, Any], key: str, default: int | None) -> int | None:
    value = params.get(key, default)
    if value is None:
        return default
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(f"sampling_params.{key} must be an integer, got {value!r}")
    return value


def _boolean(params: dict[str, Any], key: str, default: bool) -> bool:
    value = params.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise RequestError(f"sampling_params.{key} must be true or false, got {value!r}")
    return value


def parse_sampling_params(raw: Any, *, vocab_size: int) -> SamplingParams:
    """Validate one `sampling_params` dict (None = all defaults) against SGLang's rules."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise RequestError(f"sampling_params must be an object, got {type(raw).__name__}")
    unknown = sorted(set(raw) - _KNOWN_KEYS)
    if unknown:
        # Real SGLang raises a TypeError from SamplingParams(**params) and answers a plain-text 500;
        # a 400 that names the keys is the same rejection with an actionable message.
        raise RequestError(f"unknown sampling_params keys: {', '.join(unknown)}")
    for key, default in _UNSUPPORTED_DEFAULTS.items():
        if raw.get(key, default) not in (default, None):
            raise RequestError(f"sampling_params.{key} is not supported by the rayless CPU engine")

    max_new_tokens = _integer(raw, "max_new_tokens", 128)
    min_new_tokens = _integer(raw, "min_new_tokens", 0)
    temperature = _number(raw, "temperature", 1.0)
    top_p = _number(raw, "top_p", 1.0)
    top_k = _integer(raw, "top_k", -1)
    min_p = _number(raw, "min_p", 0.0)
    n = _integer(raw, "n", 1)
    seed = _integer(raw, "sampling_seed", None)
    assert max_new_tokens is not None and min_new_tokens is not None and top_k is not None and n is not None

    if max_new_tokens < 0:
        raise RequestError(f"sampling_params.max_new_tokens must be >= 0, got {max_new_tokens}")
    if not 0 <= min_new_tokens <= max_new_tokens:
        raise RequestError(
            f"sampling_params.min_new_tokens must be in [0, max_new_tokens={max_new_tokens}], got {min_new_tokens}"
        )
    if temperature < 0:
        raise RequestError(f"sampling_params.temperature must be >= 0, got {temperature}")
    if not 0 < top_p <= 1:
        raise RequestError(f"sampling_params.top_p must be in (0, 1], got {top_p}")
    if top_k == 0 or top_k < -1:
        raise RequestError(f"sampling_params.top_k must be -1 (disabled) or at least 1, got {top_k}")
    if not 0 <= min_p <= 1:
        raise RequestError(f"sampling_params.min_p must be in [0, 1], got {min_p}")
    if n < 1:
        raise RequestError(f"sampling_params.n must be >= 1, got {n}")

    stop_raw = raw.get("stop")
    if stop_raw is None:
        stop: tuple[str, ...] = ()
    elif isinstance(stop_raw, str):
        stop = (stop_raw,) if stop_raw else ()
    elif isinstance(stop_raw, list) and all(isinstance(s, str) for s in stop_raw):
        stop = tuple(s for s in stop_raw if s)
    else:
        raise RequestError("sampling_params.stop must be a string or a list of strings")

    ids_raw = raw.get("stop_token_ids")
    if ids_raw is None:
        stop_ids: frozenset[int] = frozenset()
    elif isinstance(ids_raw, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in ids_raw):
        bad = [i for i in ids_raw if not 0 <= i < vocab_size]
        if bad:
            raise RequestError(
                f"sampling_params.stop_token_ids out of the vocabulary [0, {vocab_size}): {bad}"
            )
        stop_ids = frozenset(ids_raw)
    else:
        raise RequestError("sampling_params.stop_token_ids must be a list of integers")

    return SamplingParams(
        max_new_tokens=max_new_tokens,
        min_new_tokens=min_new_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        min_p=min_p,
        stop=stop,
        stop_token_ids=stop_ids,
        ignore_eos=_boolean(raw, "ignore_eos", False),
        skip_special_tokens=_boolean(raw, "skip_special_tokens", True),
        no_stop_trim=_boolean(raw, "no_stop_trim", False),
        n=n,
        sampling_seed=seed,
    )


@dataclass
class RowSampling:
    """How to pick the next token of one sequence in one step (built by the scheduler, read by the runner)."""

    temperature: float
    top_p: float
    top_k: int
    min_p: float
    generator: torch.Generator
    banned_ids: Sequence[int] = ()
    top_logprobs_num: int = 0


@dataclass
class RowResult:
    token: int
    logprob: float
    top_logprobs: list[tuple[float, int]] = field(default_factory=list)


def sample_rows(logits: torch.Tensor, rows: Sequence[RowSampling]) -> list[RowResult]:
    """Sample one token per row of `logits` ([N, V], float32). See the module invariant for the logprobs."""
    logits = logits.float()
    count, vocab = logits.shape
    logprobs = torch.log_softmax(logits, dim=-1)
    masked = logits
    if any(row.banned_ids for row in rows):
        masked = logits.clone()
        for index, row in enumerate(rows):
            if row.banned_ids:
                masked[index, list(row.banned_ids)] = -math.inf

    tokens = torch.empty(count, dtype=torch.long)
    greedy = [i for i, row in enumerate(rows) if row.temperature == 0.0]
    sampled = [i for i, row in enumerate(rows) if row.temperature != 0.0]
    if greedy:
        tokens[greedy] = masked[greedy].argmax(dim=-1)
    if sampled:
        sub = rows_subset(rows, sampled)
        temps = torch.tensor([row.temperature for row in sub]).unsqueeze(1)
        scaled = masked[sampled] / temps
        if any(row.top_k > 0 or row.top_p < 1.0 or row.min_p > 0.0 for row in sub):
            sorted_logits, order = scaled.sort(dim=-1, descending=True)
            probs = torch.softmax(sorted_logits, dim=-1)
            ranks = torch.arange(vocab).unsqueeze(0)
            top_k = torch.tensor([row.top_k if row.top_k > 0 else vocab for row in sub]).unsqueeze(1)
            top_p = torch.tensor([row.top_p for row in sub]).unsqueeze(1)
            min_p = torch.tensor([row.min_p for row in sub]).unsqueeze(1)
            cumulative = probs.cumsum(dim=-1)
            drop = ranks >= top_k
            drop |= (cumulative - probs) > top_p
            drop |= probs < min_p * probs[:, :1]
            drop[:, 0] = False  # the most likely token always survives the filters
            probs = probs.masked_fill(drop, 0.0)
        else:
            # No filter asked for: sample the full distribution without sorting it.
            order = None
            probs = torch.softmax(scaled, dim=-1)
        cumulative = probs.cumsum(dim=-1)
        # Inverse-CDF sampling with one uniform draw per row from that row's own generator.
        uniforms = torch.cat([torch.rand(1, generator=row.generator) for row in sub])
        targets = (uniforms * cumulative[:, -1]).unsqueeze(1)
        choice = torch.searchsorted(cumulative, targets, right=True).clamp_(max=vocab - 1)
        # A draw that lands on a zero-probability slot (rounding at the tail) moves back to the last kept one.
        kept_last = (probs > 0).long().cumsum(dim=-1).argmax(dim=-1, keepdim=True)
        choice = torch.minimum(choice, kept_last)
        tokens[sampled] = (choice if order is None else order.gather(1, choice)).squeeze(1)

    token_logprobs = logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1).tolist()
    token_list = tokens.tolist()
    results = [RowResult(token=t, logprob=lp) for t, lp in zip(token_list, token_logprobs, strict=True)]
    wanted = [i for i, row in enumerate(rows) if row.top_logprobs_num > 0]
    if wanted:
        k = min(vocab, max(rows[i].top_logprobs_num for i in wanted))
        values, indices = logprobs[wanted].topk(k, dim=-1)
        for position, i in enumerate(wanted):
            num = rows[i].top_logprobs_num
            results[i].top_logprobs = list(
                zip(values[position, :num].tolist(), indices[position, :num].tolist(), strict=True)
            )
    return results


def rows_subset(rows: Sequence[RowSampling], indices: Sequence[int]) -> list[RowSampling]:
    return [rows[i] for i in indices]
