"""Reading a `/generate` answer from its bytes: one typed decode (types checked in C) and then the checks no type
can express, with the generic path as the fallback.

Owns `read_generate_answer`. Invariant: its verdict on an answer's bytes is that of the generic path (bounded
`decode_json`, then `replies.check_generate_body`): the same checked replies, or `EngineReplyError` with the same
message. An answer of SGLang's own shape (by far the common case) is decoded once, into the typed schema, and
never into plain JSON; the fields the schema skips are held to the depth limit from the bytes
(`check_depth_of_bytes`). Whatever the typed schema does not cover (a reply before SGLang 0.5.1 with no
`output_ids`, two-element logprob pairs, any value of a wrong type) is decoded again by the generic path, whose
message names the field. Why two paths: the generic one walks every value in Python (about 9x a bare decode for
a reply with logprobs).
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Mapping
from typing import Annotated, Literal

import anyio
import msgspec
from msgspec import UNSET, UnsetType

from coordinator.engines.errors import EngineReplyError
from coordinator.engines.replies import (
    INT32_LIMIT,
    FinishReason,
    GenerateAnswer,
    GenerateReply,
    asks_tokens,
    check_generate_body,
    per_reply,
)
from workers.boundary.errors import BoundaryError
from workers.boundary.json_input import (
    PARSE_IN_THREAD_BYTES,
    JsonLimits,
    JsonValue,
    check_bounds,
    check_depth_of_bytes,
    decode_json,
)

_Count = Annotated[int, msgspec.Meta(ge=0)]
_Triple = tuple[float, int, str | None]
_InputTriple = tuple[float | None, int, str | None]


class _Finish(msgspec.Struct):
    type: Literal["stop", "length", "abort"]
    matched: int | str | list[int] | None = None
    length: int | None = None
    message: str | None = None


class _Meta(msgspec.Struct):
    finish_reason: _Finish | None = None
    output_token_logprobs: list[_Triple] | None = None
    input_token_logprobs: list[_InputTriple] | UnsetType = UNSET
    output_top_logprobs: list[list[_InputTriple]] | None = None
    id: str | int | None = None
    weight_version: str | int | None = None
    prompt_tokens: _Count | UnsetType = UNSET
    completion_tokens: _Count | UnsetType = UNSET
    cached_tokens: _Count | UnsetType = UNSET
    reasoning_tokens: _Count | UnsetType = UNSET
    num_retractions: _Count | UnsetType = UNSET
    output_token_logprobs_length: _Count | UnsetType = UNSET
    e2e_latency: float | None = None
    spec_accept_rate: float | None = None
    spec_accept_length: float | None = None


class _Reply(msgspec.Struct):
    meta_info: _Meta
    output_ids: list[int]
    text: str | UnsetType | None = UNSET
    prompt_token_ids: list[int] | UnsetType = UNSET


_ANSWER = msgspec.json.Decoder(_Reply | list[_Reply])


class _NotCovered(Exception):
    """The answer is outside the typed path's cover: the generic path gives the verdict."""


def _ids_in(ids: list[int], limit: int) -> bool:
    return not ids or (min(ids) >= 0 and max(ids) < limit)


def _check_reply(reply: _Reply, limit: int, logprobs_asked: bool, expect_tokens: bool) -> GenerateReply:
    """The checks beyond types; anything that fails is re-checked by the generic path for its message.
    No float needs a finiteness check: msgspec reads no NaN (not JSON) and refuses a number past float range."""
    meta = reply.meta_info
    finish = meta.finish_reason
    ids = reply.output_ids
    text = reply.text
    # Runs once per reply of every rollout request: the checks are inlined and read the triples with
    # C-level `map(itemgetter)` rather than Python comprehensions (same verdicts).
    if text is None or finish is None or (ids and (min(ids) < 0 or max(ids) >= limit)):
        raise _NotCovered
    triples = meta.output_token_logprobs
    logprobs: tuple[float, ...] | None = None
    if triples is not None or logprobs_asked:
        if triples is None or len(triples) != len(ids) or list(map(_second, triples)) != ids:
            raise _NotCovered
        logprobs = tuple(map(_first, triples))
    if not ids and expect_tokens and finish.type != "abort":
        raise _NotCovered
    inputs: tuple[float | None, ...] | None = None
    if meta.input_token_logprobs is not UNSET:
        given = meta.input_token_logprobs
        if not _ids_in(list(map(_second, given)), limit) or None in [triple[0] for triple in given[1:]]:
            raise _NotCovered
        inputs = tuple(map(_first, given))
    if reply.prompt_token_ids is not UNSET and not _ids_in(reply.prompt_token_ids, limit):
        raise _NotCovered
    matched = finish.matched
    if type(matched) is list:
        matched = tuple(matched)
    version, rid = meta.weight_version, meta.id
    tops = meta.output_top_logprobs
    return GenerateReply(None if text is UNSET else text, tuple(ids), logprobs,
                         FinishReason(finish.type, matched, finish.length, finish.message),
                         None if version is None else str(version), None if rid is None else str(rid), inputs,
                         None if tops is None else [[list(entry) for entry in position] for position in tops])


_first, _second = operator.itemgetter(0), operator.itemgetter(1)


def read_generate_answer(raw: bytes, url: str, payload: Mapping[str, JsonValue], vocab_size: int | None,
                         limits: JsonLimits, *, source: str | None = None) -> GenerateAnswer:
    """The answer from `url`'s bytes, each reply checked, or `EngineReplyError`. `source` names the peer in
    decoding errors (the request's URL), `url` in check errors (the engine's)."""
    where = f"engine {source or url}"
    try:
        check_bounds(raw, where, limits)
        typed = _ANSWER.decode(raw)
        replies = typed if isinstance(typed, list) else [typed]
        asked = per_reply(payload.get("return_logprob", False), len(replies))
        budgets = per_reply(payload.get("sampling_params"), len(replies))
        limit = vocab_size if vocab_size is not None else INT32_LIMIT
        checked = [_check_reply(reply, limit, bool(logprobs), asks_tokens(params))
                   for reply, logprobs, params in zip(replies, asked, budgets, strict=True)]
        check_depth_of_bytes(raw, where, limits.max_depth)  # the fields the schema skipped were not decoded
        return GenerateAnswer(tuple(checked), raw)
    except BoundaryError as exc:
        raise EngineReplyError(source or url, exc.reason) from None
    except (msgspec.ValidationError, msgspec.DecodeError, RecursionError, _NotCovered):
        pass
    try:
        value = decode_json(raw, where, limits)
    except BoundaryError as exc:
        raise EngineReplyError(source or url, exc.reason) from None
    return GenerateAnswer(tuple(check_generate_body(value, url, payload, vocab_size)), raw)


async def read_generate_answer_async(raw: bytes, url: str, payload: Mapping[str, JsonValue], vocab_size: int | None,
                                     limits: JsonLimits, *, source: str | None = None
                                     ) -> GenerateAnswer:
    """`read_generate_answer`, in a worker thread when the answer is large enough to stall the event loop."""
    read = functools.partial(read_generate_answer, raw, url, payload, vocab_size, limits, source=source)
    if len(raw) > PARSE_IN_THREAD_BYTES:
        return await anyio.to_thread.run_sync(read)
    return read()
