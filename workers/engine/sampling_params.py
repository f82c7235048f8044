"""SGLang 0.5.x's `SamplingParams` for one /generate item: every field SGLang 0.5.23 defines is accepted and
validated as its `__post_init__`, `verify()` and `normalize()` do, with their messages.

Owns `parse_sampling_params` (a request's `sampling_params` dict → a frozen `SamplingParams`) and the stop
regex bound. Every rejection is a `RequestError` (the server answers 400 with its message); nothing here
raises a TypeError on odd input, and every number that reaches the sampler is in range for it (a top_k beyond
int64 once passed validation and aborted everyone's batch in the sampler).

What is honoured: everything that changes plain sampling — temperature/top-k/top-p/min-p, the three penalties,
logit_bias, min_new_tokens, stops (strings, token ids, regexes), n, sampling_seed, stream_interval. What is
not: constrained decoding (json_schema, regex, ebnf, structural_tag), beam search (beam_width > 1) and
watermarking (enabled); each is a 400 naming the field, and only when set to a non-default value, so SGLang's
own frontend, which always sends `regex: null` and `stop_regex: []`, works. The internal fields SGLang also
takes as keywords (`stop_strs`, `is_normalized`, ...) are accepted and ignored, as they configure nothing a
client should set.

Deviation: SGLang answers an unknown key with a plain-text 500 (msgspec's TypeError); here it is a 400
naming the key.
"""

from __future__ import annotations

import math
import re
import reprlib
from dataclasses import dataclass
from typing import Any

import regex as regex_module  # the stop-regex matcher: like `re`, but a search can be given a timeout

from workers.boundary.json_input import JsonObject, JsonValue


class RequestError(ValueError):
    """Input the server rejects with 400 and this message."""


_repr = reprlib.Repr()
_repr.maxstring = _repr.maxother = 80
_repr.maxlist = _repr.maxdict = 8
_repr.maxlevel = 3


def show(value: object) -> str:
    """A repr short enough for an error message whatever the client sent (bounded size and depth)."""
    return _repr.repr(value)


SAMPLING_EPS = 1e-6  # SGLang: 0 <= temperature < this is greedy
TOP_K_ALL = 1 << 30
MAX_STOP_COUNT = 32
MAX_STOP_REGEX_COUNT = 32
MAX_STOP_REGEX_BYTES = 256
UNBOUNDED = 1 << 30  # a stop regex whose match length has no bound: the whole output is searched
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1

_GRAMMARS = ("json_schema", "regex", "ebnf", "structural_tag")
_INTERNAL = (
    "stop_strs",
    "stop_regex_strs",
    "stop_str_max_len",
    "stop_regex_max_len",
    "is_normalized",
    "ebnf_full_assistant",
)
KNOWN_KEYS = frozenset(
    {
        "max_new_tokens",
        "stop",
        "stop_token_ids",
        "stop_regex",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "frequency_penalty",
        "presence_penalty",
        "repetition_penalty",
        "min_new_tokens",
        "n",
        "beam_width",
        *_GRAMMARS,
        "ignore_eos",
        "skip_special_tokens",
        "spaces_between_special_tokens",
        "no_stop_trim",
        "stream_interval",
        "logit_bias",
        "sampling_seed",
        "custom_params",
        "watermark",
        *_INTERNAL,
    }
)


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int | None = 128  # None: up to the context length
    min_new_tokens: int = 0
    temperature: float = 1.0  # 0.0 = greedy (SGLang's temperature < 1e-6 lands here)
    top_p: float = 1.0
    top_k: int = -1  # -1 = the whole vocabulary; otherwise >= 1 and at most TOP_K_ALL
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    stop: tuple[str, ...] = ()
    stop_regex: tuple[str, ...] = ()
    stop_regex_max_len: int = 0  # characters a regex match can span (UNBOUNDED: no bound)
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    n: int = 1
    sampling_seed: int | None = None
    stream_interval: int | None = None

    @property
    def penalized(self) -> bool:
        return (
            self.frequency_penalty != 0.0 or self.presence_penalty != 0.0 or self.repetition_penalty != 1.0
        )


# ---- typed readers: None means the default, as in SGLang's __post_init__ --------------------------------


def _finite(value: JsonValue, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RequestError(f"{name} must be a number, got {show(value)}")
    try:
        number = float(value)
    except OverflowError:  # an int too large for a float
        raise RequestError(f"{name} is out of range: {show(value)}") from None
    if not math.isfinite(number):
        raise RequestError(f"{name} must be a finite number, got {show(value)}")
    return number


def _number(raw: JsonObject, key: str, default: float) -> float:
    value = raw.get(key)
    return default if value is None else _finite(value, f"sampling_params.{key}")


def _integer(raw: JsonObject, key: str, default: int | None) -> int | None:
    value = raw.get(key)
    if value is None:
        return default
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(f"sampling_params.{key} must be an integer, got {show(value)}")
    if not INT64_MIN <= value <= INT64_MAX:
        raise RequestError(f"sampling_params.{key} must be in [-2**63, 2**63 - 1], got {show(value)}")
    return value


def _boolean(raw: JsonObject, key: str, default: bool) -> bool:
    value = raw.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise RequestError(f"sampling_params.{key} must be true or false, got {show(value)}")
    return value


def _strings(raw: JsonObject, key: str) -> list[str]:
    value = raw.get(key)
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        return value
    raise RequestError(f"sampling_params.{key} must be a string or a list of strings")


# ---- stop regexes --------------------------------------------------------------------------------------


def regex_max_chars(pattern: str) -> int:
    """An upper bound on the characters a match of `pattern` spans (SGLang's get_max_seq_length)."""
    try:
        import re._parser as parser  # Python 3.11+
    except ImportError:  # pragma: no cover - Python 3.10
        import sre_parse as parser  # type: ignore[no-redef]

    return min(_subpattern_max(parser, parser.parse(pattern)), UNBOUNDED)


def _subpattern_max(parser: Any, subpattern: Any) -> int:
    total = 0
    for op, value in subpattern:
        if op in (parser.LITERAL, parser.IN, parser.ANY):
            total += 1
        elif op == parser.SUBPATTERN:
            total += _subpattern_max(parser, value[3])
        elif op == parser.BRANCH:
            total += max(_subpattern_max(parser, branch) for branch in value[1])
        elif op in (parser.MAX_REPEAT, parser.MIN_REPEAT):
            _, most, inner = value
            total += UNBOUNDED if most == parser.MAXREPEAT else most * _subpattern_max(parser, inner)
        elif op == parser.AT:
            pass  # ^, $, \b: zero width
        else:
            total += UNBOUNDED  # what SGLang does not bound either (lookarounds, back references, ...)
    return total


def _stop_regexes(raw: JsonObject) -> tuple[tuple[str, ...], int]:
    patterns = _strings(raw, "stop_regex")
    if len(patterns) > MAX_STOP_REGEX_COUNT:
        raise RequestError(
            f"at most {MAX_STOP_REGEX_COUNT} stop_regex patterns are allowed, got {len(patterns)}"
        )
    longest = 0
    for pattern in patterns:
        size = len(pattern.encode("utf-8", errors="surrogatepass"))
        if size > MAX_STOP_REGEX_BYTES:
            raise RequestError(f"stop_regex is {size} bytes, over the {MAX_STOP_REGEX_BYTES}-byte limit")
        try:
            re.compile(pattern)
            regex_module.compile(pattern)
            longest = max(longest, regex_max_chars(pattern))
        except (re.error, regex_module.error, RecursionError, OverflowError) as exc:
            raise RequestError(f"invalid stop_regex {show(pattern)}: {exc}") from None
    return tuple(patterns), longest


# ---- fields SGLang takes whose use here is refused or only checked -------------------------------------


def _check_unsupported(raw: JsonObject) -> None:
    grammars = [key for key in _GRAMMARS if raw.get(key) not in (None, "")]
    for key in grammars:
        if not isinstance(raw[key], str):
            raise RequestError(f"sampling_params.{key} must be a string or null")
    if len(grammars) > 1:
        raise RequestError("Only one of json_schema, regex, ebnf, or structural_tag can be set.")
    if grammars:
        raise RequestError(
            f"sampling_params.{grammars[0]}: constrained decoding is not supported by the rayless engine"
        )
    beam_width = _integer(raw, "beam_width", None)
    if beam_width is not None:
        if beam_width < 1:
            raise RequestError(f"beam_width must be at least 1, got {beam_width}.")
        if beam_width > 1:
            raise RequestError("sampling_params.beam_width > 1: beam search is not supported by the rayless engine")
    watermark = raw.get("watermark")
    if watermark is not None:
        if not isinstance(watermark, dict):
            raise RequestError("watermark must be an object")
        if set(watermark) - {"enabled", "key", "context_window"}:
            raise RequestError("watermark contains unknown fields")
        enabled = watermark.get("enabled")
        if enabled is not None and not isinstance(enabled, bool):
            raise RequestError("watermark enabled must be a boolean")
        if enabled:
            raise RequestError("sampling_params.watermark: watermarking is not supported by the rayless engine")
    custom = raw.get("custom_params")
    if custom is not None and not (
        isinstance(custom, dict)
        and all(isinstance(k, str) and _custom_value_ok(v) for k, v in custom.items())
    ):
        raise RequestError(
            "sampling_params.custom_params must be an object of JSON scalars, lists of scalars, "
            "or objects of scalars"
        )


def _scalar(value: JsonValue) -> bool:
    return value is None or isinstance(value, (bool, int, float, str))


def _custom_value_ok(value: JsonValue) -> bool:
    if isinstance(value, list):
        return all(_scalar(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _scalar(v) for k, v in value.items())
    return _scalar(value)


def _logit_bias(raw: JsonObject, vocab_size: int) -> tuple[tuple[int, float], ...]:
    value = raw.get("logit_bias")
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise RequestError("sampling_params.logit_bias must be an object of token id -> bias")
    bias: dict[int, float] = {}
    for key, amount in value.items():
        try:
            token = int(key)
        except ValueError:
            raise RequestError(f"sampling_params.logit_bias key {show(key)} is not a token id") from None
        if not 0 <= token < vocab_size:
            raise RequestError(f"logit_bias must has keys in [0, {vocab_size - 1}], got {key[:32]}.")
        bias[token] = _finite(amount, f"sampling_params.logit_bias[{show(key)}]")
    return tuple(sorted(bias.items()))


def _stop_token_ids(raw: JsonObject, vocab_size: int) -> frozenset[int]:
    value = raw.get("stop_token_ids")
    if value is None:
        return frozenset()
    if not (isinstance(value, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in value)):
        raise RequestError("sampling_params.stop_token_ids must be a list of integers")
    # Out-of-vocabulary ids would index past the logits when min_new_tokens bans them: refuse them here.
    bad = [i for i in value if not 0 <= i < vocab_size]
    if bad:
        raise RequestError(f"sampling_params.stop_token_ids out of the vocabulary [0, {vocab_size}): {bad[:8]}")
    return frozenset(value)


# ---- the whole item ------------------------------------------------------------------------------------


def _verify(v: JsonObject, max_n: int) -> None:
    """SGLang's verify(), in its order and words (plus our bounds on n and stream_interval)."""
    if v["temperature"] < 0.0:
        raise RequestError(f"temperature must be a non-negative finite number, got {v['temperature']}.")
    if not 0.0 < v["top_p"] <= 1.0:
        raise RequestError(f"top_p must be in (0, 1], got {v['top_p']}.")
    if not 0.0 <= v["min_p"] <= 1.0:
        raise RequestError(f"min_p must be in [0, 1], got {v['min_p']}.")
    if v["top_k"] < 1 and v["top_k"] != -1:
        raise RequestError(f"top_k must be -1 (disable) or at least 1, got {v['top_k']}.")
    for key in ("frequency_penalty", "presence_penalty"):
        if not -2.0 <= v[key] <= 2.0:
            raise RequestError(f"{key} must be in [-2, 2], got {v[key]}.")
    if not 0.0 < v["repetition_penalty"] <= 2.0:
        raise RequestError(
            f"repetition_penalty must be in (0, 2] (1.0 = no penalty), got {v['repetition_penalty']}."
        )
    low, high = v["min_new_tokens"], v["max_new_tokens"]
    if low < 0:
        raise RequestError(f"min_new_tokens must be in [0, max_new_tokens], got {low}.")
    if high is not None:
        if high < 0:
            raise RequestError(f"max_new_tokens must be at least 0, got {high}.")
        if low > high:
            raise RequestError(f"min_new_tokens must be in [0, max_new_tokens({high})], got {low}.")
    if not 1 <= v["n"] <= max_n:
        raise RequestError(f"sampling_params.n must be in [1, {max_n}] (the engine's --max-n), got {v['n']}")
    if v["stream_interval"] is not None and v["stream_interval"] < 1:
        raise RequestError(f"sampling_params.stream_interval must be at least 1, got {v['stream_interval']}")


def parse_sampling_params(raw: JsonValue, *, vocab_size: int, max_n: int = 128) -> SamplingParams:
    """Validate one `sampling_params` dict (None = all defaults) against SGLang's rules."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise RequestError(f"sampling_params must be an object, got {type(raw).__name__}")
    unknown = sorted(str(key) for key in set(raw) - KNOWN_KEYS)
    if unknown:
        shown = ", ".join(key[:64] for key in unknown[:8]) + (" ..." if len(unknown) > 8 else "")
        raise RequestError(f"unknown sampling_params keys: {shown}")
    _check_unsupported(raw)

    v: dict[str, Any] = {
        # Absent: 128; null: as many as the context length leaves (SGLang's Optional[int] = 128).
        "max_new_tokens": _integer(raw, "max_new_tokens", None) if "max_new_tokens" in raw else 128,
        "min_new_tokens": _integer(raw, "min_new_tokens", 0),
        "temperature": _number(raw, "temperature", 1.0),
        "top_p": _number(raw, "top_p", 1.0),
        "top_k": _integer(raw, "top_k", -1),
        "min_p": _number(raw, "min_p", 0.0),
        "frequency_penalty": _number(raw, "frequency_penalty", 0.0),
        "presence_penalty": _number(raw, "presence_penalty", 0.0),
        "repetition_penalty": _number(raw, "repetition_penalty", 1.0),
        "n": _integer(raw, "n", 1),
        "sampling_seed": _integer(raw, "sampling_seed", None),
        "stream_interval": _integer(raw, "stream_interval", None),
    }
    _verify(v, max_n)

    # normalize(): stops.
    stop = _strings(raw, "stop")
    if len(stop) > MAX_STOP_COUNT:
        raise RequestError(f"at most {MAX_STOP_COUNT} stop strings are allowed, got {len(stop)}")
    stop_regex, regex_max_len = _stop_regexes(raw)

    temperature, top_k = v.pop("temperature"), v.pop("top_k")
    return SamplingParams(
        **v,
        temperature=0.0 if temperature < SAMPLING_EPS else temperature,
        top_k=-1 if top_k == -1 else min(top_k, TOP_K_ALL),
        logit_bias=_logit_bias(raw, vocab_size),
        # An empty stop string would match every text at once; SGLang keeps it, nobody means it.
        stop=tuple(s for s in stop if s),
        stop_regex=stop_regex,
        stop_regex_max_len=regex_max_len,
        stop_token_ids=_stop_token_ids(raw, vocab_size),
        ignore_eos=_boolean(raw, "ignore_eos", False),
        skip_special_tokens=_boolean(raw, "skip_special_tokens", True),
        spaces_between_special_tokens=_boolean(raw, "spaces_between_special_tokens", True),
        no_stop_trim=_boolean(raw, "no_stop_trim", False),
    )
