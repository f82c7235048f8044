"""The check of every `/generate` reply (plain, batched or one streamed chunk) against SGLang's shape.

Owns `GenerateReply`, the typed view of one reply, `GenerateAnswer` (one answer's replies and the bytes they were
read from), and `check_generate_reply`, the one function that builds a reply from decoded JSON (the generic path;
`reply_decode` builds the same replies from the bytes on the typed path). Invariant: a reply it accepts has output ids that are ints (never floats, never bools) in
`[0, vocab_size)`, one finite logprob per id whose triple names that same id, a `finish_reason` of SGLang's
known set (`stop` / `length` / `abort`; None only in a streamed chunk), a string text and meta fields of the
types SGLang gives; anything else raises `EngineReplyError` naming the peer and the field.

The finish reasons are SGLang's `BaseFinishReason.to_json` (srt/managers/schedule_batch.py): `{"type":
"stop", "matched": int | [int] | str}`, `{"type": "length", "length": int}`, `{"type": "abort", "message",
"status_code", "err_type"}`.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import anyio
import msgspec

from coordinator.engines.errors import EngineReplyError
from workers.boundary.json_input import JsonValue

FINISH_TYPES = frozenset({"stop", "length", "abort"})
#: with no vocabulary known yet (the tokenizer loads while the engines start), ids must fit SGLang's int32
INT32_LIMIT = 1 << 31
_INT_FIELDS = ("prompt_tokens", "completion_tokens", "cached_tokens", "reasoning_tokens", "num_retractions",
               "output_token_logprobs_length")
_NUMBER_FIELDS = ("e2e_latency", "spec_accept_rate", "spec_accept_length")


@dataclass(frozen=True, slots=True)
class ReplyRules:
    """What a reply must satisfy beyond SGLang's shape: the vocabulary, whether logprobs were asked for, and
    whether it is a streamed chunk (then `finish_reason` may be None and `text` null), whether it may be empty."""

    vocab_size: int | None = None
    logprobs: bool = False
    stream: bool = False
    #: the request let it generate (max_new_tokens > 0): a finished reply that is not an abort has a token
    expect_tokens: bool = False


# FinishReason and GenerateReply are built once per sample of every rollout: frozen msgspec Structs build in C,
# ~9x a frozen dataclass's per-field `object.__setattr__` (the same fields, order, equality, hash, immutability).
class FinishReason(msgspec.Struct, frozen=True):
    type: str
    matched: int | str | tuple[int, ...] | None = None
    length: int | None = None
    message: str | None = None


class GenerateReply(msgspec.Struct, frozen=True):
    """One checked reply. `logprobs` is None when the request did not ask for them; `input_logprobs` holds
    `meta_info.input_token_logprobs`' logprobs when the engine sent them (the first may be None: SGLang has no
    logprob for a prompt's first token)."""

    text: str | None
    output_ids: tuple[int, ...]
    logprobs: tuple[float, ...] | None
    finish: FinishReason | None
    weight_version: str | None
    rid: str | None
    input_logprobs: tuple[float | None, ...] | None = None
    #: `meta_info.output_top_logprobs` as the engine sent it (a request with `top_logprobs_num`: each output
    #: token's top-k [logprob, id, text]; miles' top-k OPD keeps the student's), else None
    output_top_logprobs: JsonValue = None


@dataclass(frozen=True, slots=True)
class GenerateAnswer:
    """One `/generate` answer, checked: its replies (prompt-major, one per prompt × n) and the bytes they were
    read from, which only a forwarder (the hook endpoint) sends on as they came."""

    replies: tuple[GenerateReply, ...]
    body: bytes


_NONE = object()


def _fail(url: str, reason: str) -> EngineReplyError:
    return EngineReplyError(url, reason)


def _is_int(value: JsonValue) -> bool:
    return type(value) is int  # bool is a subclass of int: True is no token id


def _is_number(value: JsonValue) -> bool:
    return type(value) in (int, float)


def check_ids(ids: JsonValue, url: str, field: str, vocab_size: int | None) -> tuple[int, ...]:
    """A list of token ids: ints in `[0, vocab_size)` (int32 when the vocabulary is not known)."""
    if not isinstance(ids, list):
        raise _fail(url, f"{field} is {type(ids).__name__}, not a list of token ids")
    bad = next((value for value in ids if not _is_int(value)), _NONE)
    if bad is not _NONE:
        raise _fail(url, f"{field} holds {bad!r:.40} ({type(bad).__name__}); token ids are ints")
    limit = vocab_size if vocab_size is not None else INT32_LIMIT
    if ids and (min(ids) < 0 or max(ids) >= limit):
        value = min(ids) if min(ids) < 0 else max(ids)
        raise _fail(url, f"{field} holds token id {value}, outside the vocabulary [0, {limit})")
    return tuple(ids)


def _check_triples(triples: JsonValue, url: str, field: str, vocab_size: int | None, *,
                   first_may_be_null: bool) -> list[float | None]:
    """SGLang's `[logprob, token_id, text | null]` triples: finite logprobs, ids in the vocabulary."""
    if not isinstance(triples, list):
        raise _fail(url, f"meta_info.{field} is {type(triples).__name__}, not a list")
    out: list[float | None] = []
    for index, triple in enumerate(triples):
        if not isinstance(triple, list) or len(triple) not in (2, 3):
            raise _fail(url, f"meta_info.{field}[{index}] is {triple!r:.60}, not [logprob, token_id, text]")
        logprob, token = triple[0], triple[1]
        if logprob is None and first_may_be_null and index == 0:
            out.append(None)
        elif not _is_number(logprob) or not math.isfinite(logprob):
            raise _fail(url, f"meta_info.{field}[{index}] has logprob {logprob!r:.40}; logprobs are finite numbers")
        else:
            out.append(float(logprob))
        if not _is_int(token) or not 0 <= token < (vocab_size or INT32_LIMIT):
            raise _fail(url, f"meta_info.{field}[{index}] has token id {token!r:.40}, not an int in the vocabulary")
        if len(triple) == 3 and triple[2] is not None and not isinstance(triple[2], str):
            raise _fail(url, f"meta_info.{field}[{index}] has token text {triple[2]!r:.40}, not a string")
    return out


def check_finish(value: JsonValue, url: str, *, stream: bool) -> FinishReason | None:
    """SGLang's finish reason: a dict whose `type` is stop, length or abort (None: not finished yet)."""
    if value is None:
        if stream:
            return None
        raise _fail(url, "meta_info.finish_reason is null in a finished reply")
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise _fail(url, f"meta_info.finish_reason is {value!r:.80}, not {{'type': 'stop' | 'length' | 'abort'}}")
    kind = value["type"]
    if kind not in FINISH_TYPES:
        raise _fail(url, f"meta_info.finish_reason.type is {kind!r:.40}, not one of {sorted(FINISH_TYPES)}")
    matched = value.get("matched")
    if matched is not None and not (_is_int(matched) or isinstance(matched, str) or (
            isinstance(matched, list) and all(_is_int(item) for item in matched))):
        raise _fail(url, f"meta_info.finish_reason.matched is {matched!r:.40}, not a token id, ids or a string")
    length = value.get("length")
    if length is not None and not _is_int(length):
        raise _fail(url, f"meta_info.finish_reason.length is {length!r:.40}, not an int")
    message = value.get("message")
    if message is not None and not isinstance(message, str):
        raise _fail(url, f"meta_info.finish_reason.message is {message!r:.40}, not a string")
    return FinishReason(kind, tuple(matched) if isinstance(matched, list) else matched, length, message)


def _check_meta_fields(meta: Mapping[str, JsonValue], url: str) -> None:
    for field in _INT_FIELDS:
        if field in meta and not (_is_int(meta[field]) and meta[field] >= 0):
            raise _fail(url, f"meta_info.{field} is {meta[field]!r:.40}, not a count")
    for field in _NUMBER_FIELDS:
        if field in meta and meta[field] is not None and not (
                _is_number(meta[field]) and math.isfinite(meta[field])):
            raise _fail(url, f"meta_info.{field} is {meta[field]!r:.40}, not a finite number")
    for field in ("id", "weight_version"):  # SGLang's are strings; an int version is read as its text
        item = meta.get(field)
        if item is not None and (isinstance(item, bool) or not isinstance(item, str | int)):
            raise _fail(url, f"meta_info.{field} is {item!r:.40}, not a string")


def check_generate_reply(value: JsonValue, url: str, rules: ReplyRules) -> GenerateReply:
    """The typed view of one reply from `url`, or `EngineReplyError` saying what is wrong with it."""
    if not isinstance(value, dict):
        raise _fail(url, f"the reply is {type(value).__name__}, not a JSON object")
    meta = value.get("meta_info")
    if not isinstance(meta, dict):
        raise _fail(url, f"meta_info is {type(meta).__name__}, not an object")
    text = value.get("text")
    if text is not None and not isinstance(text, str):
        raise _fail(url, f"text is {type(text).__name__}, not a string")
    if text is None and "text" in value and not rules.stream:
        raise _fail(url, "text is null in a finished reply")
    _check_meta_fields(meta, url)
    finish = check_finish(meta.get("finish_reason"), url, stream=rules.stream)
    triples = meta.get("output_token_logprobs")
    ids = check_ids(value["output_ids"], url, "output_ids", rules.vocab_size) if "output_ids" in value else None
    logprobs = None
    if triples is not None or rules.logprobs:
        if triples is None:
            raise _fail(url, "no meta_info.output_token_logprobs, though the request asked for logprobs")
        logprobs = _check_triples(triples, url, "output_token_logprobs", rules.vocab_size, first_may_be_null=False)
    if ids is None:
        if triples is None:
            raise _fail(url, "no output_ids (and no output_token_logprobs to read them from)")
        ids = tuple(triple[1] for triple in triples)  # SGLang before 0.5.1: the triples carry the ids
    if logprobs is not None:
        if len(logprobs) != len(ids):
            raise _fail(url, f"{len(ids)} output ids but {len(logprobs)} logprobs")
        mismatch = next((i for i, (t, token) in enumerate(zip(triples, ids, strict=True)) if t[1] != token), None)
        if mismatch is not None:
            raise _fail(url, f"output_token_logprobs[{mismatch}] names token {triples[mismatch][1]}, but "
                             f"output_ids[{mismatch}] is {ids[mismatch]}")
    if not ids and rules.expect_tokens and not rules.stream and finish is not None and finish.type != "abort":
        raise _fail(url, f"no output ids, though it finished with {finish.type!r} (only an abort ends empty)")
    inputs = None
    if "input_token_logprobs" in meta:
        inputs = tuple(_check_triples(meta["input_token_logprobs"], url, "input_token_logprobs", rules.vocab_size,
                                      first_may_be_null=True))
    if "prompt_token_ids" in value:
        check_ids(value["prompt_token_ids"], url, "prompt_token_ids", rules.vocab_size)
    version = meta.get("weight_version")
    rid = meta.get("id")
    return GenerateReply(text, ids, None if logprobs is None else tuple(logprobs),  # type: ignore[arg-type]
                         finish, None if version is None else str(version), None if rid is None else str(rid),
                         inputs, meta.get("output_top_logprobs"))


def per_reply(values: JsonValue, count: int) -> list[JsonValue]:
    """A request field of each reply: one value for all, or one per prompt (replies are prompt-major)."""
    if not isinstance(values, list):
        return [values] * count
    if not values:
        return [None] * count
    per_prompt = max(1, count // len(values))
    return [values[min(i // per_prompt, len(values) - 1)] for i in range(count)]


def asks_tokens(params: JsonValue) -> bool:
    """Whether a prompt's sampling params let it generate (SGLang's max_new_tokens defaults to 128)."""
    budget = params.get("max_new_tokens") if isinstance(params, dict) else None
    return not (type(budget) is int and budget <= 0)


def check_generate_body(body: JsonValue, url: str, payload: Mapping[str, JsonValue], vocab_size: int | None,
                        *, stream: bool = False) -> Sequence[GenerateReply]:
    """Every reply of one `/generate` answer (a dict, or a list for a batch), each checked."""
    replies = body if isinstance(body, list) else [body]
    asked = per_reply(payload.get("return_logprob", False), len(replies))
    budgets = per_reply(payload.get("sampling_params"), len(replies))
    return [check_generate_reply(reply, url, ReplyRules(vocab_size, bool(logprobs), stream, asks_tokens(params)))
            for reply, logprobs, params in zip(replies, asked, budgets, strict=True)]


def check_chat_reply(body: JsonValue, url: str, vocab_size: int | None) -> None:
    """An OpenAI chat answer with SGLang's `return_meta_info` (what the session server trains on): its first
    choice's output logprob triples finite and in the vocabulary, its finish reason a string or null."""
    choices = body.get("choices") if isinstance(body, dict) else None
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise _fail(url, "the chat answer has no choices[0] object")
    choice = choices[0]
    finish = choice.get("finish_reason")
    if finish is not None and not isinstance(finish, str):
        raise _fail(url, f"choices[0].finish_reason is {finish!r:.40}, not a string")
    meta = choice.get("meta_info")
    if isinstance(meta, dict):
        _check_meta_fields(meta, url)
        if "output_token_logprobs" in meta:
            _check_triples(meta["output_token_logprobs"], url, "output_token_logprobs", vocab_size,
                           first_may_be_null=False)


#: above this many output ids in one answer the check (~2 µs a token) moves off the event loop
CHECK_IN_THREAD_TOKENS = 16_384


def _tokens_in(body: JsonValue) -> int:
    replies = body if isinstance(body, list) else [body]
    return sum(len(r["output_ids"]) for r in replies if isinstance(r, dict) and isinstance(r.get("output_ids"), list))


async def check_generate_body_async(body: JsonValue, url: str, payload: Mapping[str, JsonValue], vocab_size: int | None,
                                    *, stream: bool = False) -> Sequence[GenerateReply]:
    """`check_generate_body`, in a worker thread when the answer is large enough to stall the event loop."""
    if _tokens_in(body) > CHECK_IN_THREAD_TOKENS:
        return await anyio.to_thread.run_sync(
            functools.partial(check_generate_body, body, url, payload, vocab_size, stream=stream))
    return check_generate_body(body, url, payload, vocab_size, stream=stream)
