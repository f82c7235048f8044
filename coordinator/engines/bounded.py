"""Reading a peer's reply with a size cap, as it streams in: no reply is held whole past its limit.

Owns the caps (`DEFAULT_REPLY_BYTES` for control answers; `generate_reply_limit` derives a `/generate`
reply's from the request itself: tokens asked for × bytes a token takes with its logprobs, plus headroom),
the capped body and SSE-line readers, and the decoding of a body through the boundary layer's bounded JSON
decoder. Invariant: a reader never holds more than its cap plus one network chunk; going over raises
`EngineReplyError` naming the peer at once, and the rest of the reply is never read.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Protocol

from coordinator.engines.errors import EngineReplyError
from workers.boundary.errors import BoundaryError
from workers.boundary.json_input import JsonLimits, JsonValue, decode_json_async


class BodyStream(Protocol):
    """An answer whose body is still to be read: an `httpx.Response` opened with `stream`, or the engine
    client's view of an aiohttp response (`client._AiohttpBody`)."""

    @property
    def headers(self) -> Mapping[str, str]: ...

    def aiter_bytes(self) -> AsyncIterator[bytes]: ...


#: the cap of any reply but /generate's (model and server info, control answers, a reward service's answer)
DEFAULT_REPLY_BYTES = 16 << 20
#: one generated token in a reply: its id (8 B), its logprob triple with text (~50 B), its text (≤ 4 UTF-8
#: bytes, up to 6x when JSON-escaped), measured ~70 B with our engine's replies; 256 leaves room for SGLang's
BYTES_PER_TOKEN = 256
#: each `top_logprobs_num` entry adds one triple per token
BYTES_PER_TOP_LOGPROB = 96
#: meta_info and the reply's own fields, per reply
REPLY_HEADROOM = 64 << 10
#: what is read of an error answer (its text becomes the error's message; the rest is left unread)
ERROR_BYTES = 64 << 10
#: what a request without max_new_tokens is allowed (SGLang's default is 128; a custom engine may differ)
DEFAULT_TOKENS = 4096
#: wraps a body's chunks (the stall detector, `stall.progressing`); `between()` is True between two SSE lines
Watch = Callable[[AsyncIterator[bytes], Callable[[], bool]], AsyncIterator[bytes]]
#: no reply of any size is read whole past this
MAX_REPLY_BYTES = 1 << 30
REPLY_DEPTH = 32  # SGLang's deepest field: a batch list > reply > meta_info > top logprobs > entry > triple


def _count(payload: Mapping[str, JsonValue]) -> tuple[int, int]:
    """(prompts, prompt tokens or characters) of a `/generate` request."""
    ids, text = payload.get("input_ids"), payload.get("text")
    if isinstance(ids, list) and ids and isinstance(ids[0], list):
        return len(ids), sum(len(item) for item in ids if isinstance(item, list))
    if isinstance(text, list):
        return max(len(text), 1), sum(len(item) for item in text if isinstance(item, str))
    if isinstance(ids, list):
        return 1, len(ids)
    return 1, len(text) if isinstance(text, str) else 0


def _int(value: JsonValue, default: int) -> int:
    return value if type(value) is int and value >= 0 else default


def generate_reply_limit(payload: Mapping[str, JsonValue]) -> int:
    """The byte cap of the reply to `payload`: what its longest honest reply can take, and headroom."""
    prompts, prompt_tokens = _count(payload)
    params = payload.get("sampling_params") or {}
    params_list = params if isinstance(params, list) else [params] * prompts
    tokens = 0
    for item in params_list:  # per prompt of every request: `_int` inlined (a non-negative int, else the default)
        if type(item) is not dict:
            tokens += DEFAULT_TOKENS
            continue
        new, n = item.get("max_new_tokens"), item.get("n", 1)
        new = (new or 1) if type(new) is int and new >= 0 else DEFAULT_TOKENS
        tokens += new * n if type(n) is int and n >= 1 else new
    replies = max(prompts, len(params_list))
    top = payload.get("top_logprobs_num")
    top_n = max((_int(v, 0) for v in top), default=0) if isinstance(top, list) else _int(top, 0)
    asked = payload.get("token_ids_logprob")  # SGLang's: these ids' logprobs at every position too
    asked_n = (max((len(v) for v in asked if isinstance(v, list)), default=0) if asked and isinstance(asked[0], list)
               else len(asked) if isinstance(asked, list) else 0)
    per_position = payload.get("token_ids_logprob_positions")  # miles' patched SGLang's, one id list per position
    if isinstance(per_position, list):
        rows = [row for row in per_position if isinstance(row, list)]
        asked_n = max(asked_n, max((len(r) if r and not isinstance(r[0], list) else
                                    max((len(x) for x in r if isinstance(x, list)), default=0)
                                    for r in rows), default=0))
    per_token = BYTES_PER_TOKEN + BYTES_PER_TOP_LOGPROB * (top_n + asked_n)
    if payload.get("return_logprob") and payload.get("logprob_start_len") not in (None, -1):
        tokens += prompt_tokens  # input logprobs come back too
    return min(MAX_REPLY_BYTES, tokens * per_token + (replies + 1) * REPLY_HEADROOM)


def chat_reply_limit(body: Mapping[str, JsonValue] | None) -> int:
    """The byte cap of an OpenAI chat answer with SGLang's meta info: each token comes back twice (OpenAI's
    `logprobs.content` and `meta_info.output_token_logprobs`); never below `DEFAULT_REPLY_BYTES`."""
    body = body or {}
    tokens = body.get("max_completion_tokens") or body.get("max_tokens")
    top = body.get("top_logprobs")
    asked = {"sampling_params": {"max_new_tokens": tokens, "n": body.get("n")}, "top_logprobs_num": top}
    return min(MAX_REPLY_BYTES, max(DEFAULT_REPLY_BYTES, 2 * generate_reply_limit(asked)))


@functools.lru_cache(maxsize=256)  # a rollout asks the same few caps for every request; JsonLimits is frozen
def limits_for(max_bytes: int) -> JsonLimits:
    # An honest reply holds at most ~5 values per token; a value takes at least 2 bytes ("0,").
    return JsonLimits(max_bytes=max_bytes, max_depth=REPLY_DEPTH, max_items=max(max_bytes // 2, 1024))


def _declared_length(resp: BodyStream) -> int | None:
    value = resp.headers.get("content-length")
    return int(value) if value is not None and value.isdigit() else None


def _chunks(resp: BodyStream, watch: Watch | None, between: Callable[[], bool]) -> AsyncIterator[bytes]:
    return resp.aiter_bytes() if watch is None else watch(resp.aiter_bytes(), between)


async def read_capped(resp: BodyStream, cap: int, url: str,
                      on_chunk: Callable[[int], None] | None = None) -> bytes:
    """The whole body of `resp`, refused as soon as it passes `cap` bytes (or declares more); each chunk's size
    told to `on_chunk` (the stall rules' clock, `stall.ReplyClock`) when given."""
    declared = _declared_length(resp)
    if declared is not None and declared > cap and "content-encoding" not in resp.headers:
        raise EngineReplyError(url, f"reply of {declared} bytes is over the limit of {cap} for this request")
    chunks: list[bytes] = []
    size = 0
    async for chunk in resp.aiter_bytes():
        if on_chunk is not None:
            on_chunk(len(chunk))
        chunks.append(chunk)
        size += len(chunk)
        if size > cap:
            raise EngineReplyError(url, f"reply passed the limit of {cap} bytes for this request; not read further")
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)  # a reply in one chunk is not copied


async def read_prefix(resp: BodyStream, limit: int = ERROR_BYTES,
                      on_chunk: Callable[[int], None] | None = None) -> bytes:
    """At most `limit` bytes of `resp`'s body (an error answer: its beginning is its message)."""
    body = bytearray()
    async for chunk in resp.aiter_bytes():
        if on_chunk is not None:
            on_chunk(len(chunk))
        body += chunk
        if len(body) >= limit:
            break
    return bytes(body[:limit])


async def iter_lines_capped(resp: BodyStream, cap: int, url: str,
                            watch: Watch | None = None) -> AsyncIterator[bytes]:
    """The lines of a streamed body (SSE), each refused as soon as it passes `cap` bytes; the chunks go through
    `watch`, told when the reader stands between two lines."""
    pending = bytearray()
    async for chunk in _chunks(resp, watch, lambda: not pending):  # noqa: B023 (read at each chunk, on purpose)
        pending += chunk
        while (end := pending.find(b"\n")) >= 0:
            line = bytes(pending[:end]).rstrip(b"\r")
            del pending[:end + 1]
            yield line
        if len(pending) > cap:
            raise EngineReplyError(url, f"a streamed line passed the limit of {cap} bytes; not read further")
    if pending:
        yield bytes(pending)


async def decode_reply(body: bytes, url: str, max_bytes: int) -> JsonValue:
    """The JSON value of a reply, decoded bounded (size, depth, element count), off the loop when large."""
    try:
        return await decode_json_async(body, f"engine {url}", limits_for(max_bytes))
    except BoundaryError as exc:
        raise EngineReplyError(url, exc.reason) from None
