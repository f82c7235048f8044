"""The engine client's stall detector (`coordinator.engines.stall`) against stuck peers on 127.0.0.1.

The peers are FAKES, small servers in the test process speaking just enough HTTP/1.1: an engine that accepts
connections and answers nothing, one that answers `/health` but never a `/generate`, one that sends a
`/generate` answer's head and then nothing, and one that drips its reply (or a stream's event) a byte at a time.
These failures cannot be produced on demand with a real engine (a wedged scheduler, a half-dead network path),
which is why they are fakes. Each request ends by the stall rule — `EngineStalled` naming the engine, the wait
and the time waited — long before its read timeout; an engine that answers late but is alive is waited for.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing, asynccontextmanager

import anyio
import anyio.abc
import pytest

from coordinator.engines.client import EngineClient
from coordinator.engines.errors import EngineError, EngineStalled, EngineTimeout
from coordinator.engines.policy import NO_RETRY

STALL = 0.5
#: the /health probe's deadline: the FAKES answer /health at once, but a loaded machine can delay an answer on
#: 127.0.0.1 past a few tenths of a second, which would make an alive engine read as stalled
PROBE = 1.0
#: per requested token: PAYLOAD's 2 tokens give a generation bound of STALL + 2 × TOKEN = 1.5 s
TOKEN = 0.5
#: the read timeout every request here runs under: the stall rule must end it long before
READ = 60.0
PAYLOAD = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}}
REPLY = (b'{"text": "ab", "output_ids": [4, 5], "meta_info": {"id": "x", "prompt_tokens": 3, '
         b'"completion_tokens": 2, "finish_reason": {"type": "length", "length": 2}}}')
#: a stream's first event: one token so far, no finish reason yet
FIRST_EVENT = (b'{"text": "a", "output_ids": [4], "meta_info": {"id": "x", "prompt_tokens": 3, '
               b'"completion_tokens": 1, "finish_reason": null}}')

Handler = Callable[[anyio.abc.SocketStream, bytes], Awaitable[None]]


async def _request_head(stream: anyio.abc.SocketStream) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = await stream.receive()
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                   if line.lower().startswith(b"content-length:")), 0)
    while len(rest) < length:
        rest += await stream.receive()
    return head.split(b"\r\n", 1)[0]


@asynccontextmanager
async def fake_engine(handler: Handler) -> AsyncIterator[str]:
    """A FAKE engine on 127.0.0.1: `handler(stream, request_line)` answers each request (or never does)."""
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)
    port = listener.extra(anyio.abc.SocketAttribute.local_port)

    async def serve(stream: anyio.abc.SocketStream) -> None:
        async with stream:
            try:
                while True:
                    await handler(stream, await _request_head(stream))
            except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError):
                pass

    async with listener, anyio.create_task_group() as group:
        group.start_soon(listener.serve, serve)
        yield f"http://127.0.0.1:{port}"
        group.cancel_scope.cancel()


def head(length: int | None = None, *, content_type: bytes = b"application/json") -> bytes:
    size = b"" if length is None else b"Content-Length: %d\r\n" % length
    return b"HTTP/1.1 200 OK\r\nContent-Type: " + content_type + b"\r\n" + size + b"\r\n"


async def health_ok(stream: anyio.abc.SocketStream) -> None:
    await stream.send(head(2) + b"{}")


async def silent(stream: anyio.abc.SocketStream, line: bytes) -> None:
    """Accepts, reads the request, answers nothing (a stopped or wedged server: the kernel still accepts)."""
    await anyio.sleep_forever()


async def health_but_no_generate(stream: anyio.abc.SocketStream, line: bytes) -> None:
    """Answers every route (/health, /pause_generation, ...) but `/generate`, which it never answers."""
    if b"/generate" not in line:
        return await health_ok(stream)
    await anyio.sleep_forever()


async def head_then_nothing(stream: anyio.abc.SocketStream, line: bytes) -> None:
    if b"/health" in line:
        return await health_ok(stream)
    await stream.send(head(len(REPLY)))
    await anyio.sleep_forever()


async def drip(stream: anyio.abc.SocketStream, line: bytes) -> None:
    """The reply, one byte every 0.1 s (the issue's drill drips one a second; the rule is the same)."""
    if b"/health" in line:
        return await health_ok(stream)
    await stream.send(head(len(REPLY)))
    for byte in REPLY:
        await anyio.sleep(0.1)
        await stream.send(bytes([byte]))


async def drip_stream(stream: anyio.abc.SocketStream, line: bytes) -> None:
    """A stream whose first event is written whole, the second a byte at a time."""
    if b"/health" in line:
        return await health_ok(stream)
    await stream.send(head(content_type=b"text/event-stream").replace(b"\r\n\r\n", b"\r\nConnection: close\r\n\r\n"))
    await stream.send(b"data: " + FIRST_EVENT + b"\n\n")
    for byte in b"data: " + REPLY:
        await anyio.sleep(0.1)
        await stream.send(bytes([byte]))


async def late_but_alive(stream: anyio.abc.SocketStream, line: bytes) -> None:
    """Answers /health at once and the generate after 2.5 stall periods: a busy engine, not a stuck one."""
    if b"/health" in line:
        return await health_ok(stream)
    await anyio.sleep(2.5 * STALL)
    await stream.send(head(len(REPLY)) + REPLY)


@asynccontextmanager
async def client(read: float = READ) -> AsyncIterator[EngineClient]:
    """A client with its head watch running, as the run starts it."""
    async with EngineClient(max_connections=4, stall_timeout=STALL, probe_timeout=PROBE, generate_timeout=read,
                            token_timeout=TOKEN, retry=NO_RETRY) as c, anyio.create_task_group() as group:
        await group.start(c.watch_stalls)
        yield c
        group.cancel_scope.cancel()


async def stalled(url: str, *, stream: bool = False, seen: list[object] | None = None) -> EngineError:
    """What a `/generate` to `url` raised; the test's own deadline is far below the read timeout."""
    async with client() as c:
        with anyio.fail_after(READ / 4):
            try:
                if stream:
                    async with aclosing(c.engine(url).generate_stream(PAYLOAD)) as chunks:
                        async for chunk in chunks:
                            (seen if seen is not None else []).append(chunk)
                else:
                    await c.engine(url).generate(PAYLOAD)
            except EngineError as error:
                return error
    raise AssertionError("the request to a stuck engine returned")


async def test_an_engine_that_accepts_and_answers_nothing_is_named_stalled() -> None:
    async with fake_engine(silent) as url:
        error = await stalled(url)
    assert isinstance(error, EngineStalled) and isinstance(error, EngineTimeout)  # the dispatch's EngineError path
    assert f"engine {url}/generate stalled: POST /generate made no progress for 0.5 s" in str(error)
    assert f"/health gave none within {PROBE:g} s" in str(error)
    assert STALL <= error.elapsed < READ / 4
    assert STALL + PROBE <= error.elapsed  # a probe that got no answer, not a guess


async def test_an_answer_head_then_nothing_and_a_dripping_reply_are_stalled() -> None:
    for handler in (head_then_nothing, drip):
        async with fake_engine(handler) as url:
            error = await stalled(url)
        assert isinstance(error, EngineStalled), handler.__name__
        assert f"engine {url}/generate stalled: POST /generate made no progress" in str(error)
        assert f"under {64 << 10} (a reply dripping)" in str(error)
        assert error.elapsed < READ / 4


async def test_a_stream_whose_event_drips_is_stalled_after_its_whole_events() -> None:
    seen: list[object] = []
    async with fake_engine(drip_stream) as url:
        error = await stalled(url, stream=True, seen=seen)
    assert len(seen) == 1  # the whole first event came through; the dripping second one is what stalled
    assert isinstance(error, EngineStalled)
    assert "POST /generate (stream) made no progress" in str(error)


async def test_an_engine_answering_health_is_waited_for_with_a_warning_not_stalled(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    async with fake_engine(late_but_alive) as url, client() as c:
        out = await c.engine(url).generate(PAYLOAD)
    assert out.replies[0].output_ids == (4, 5)
    assert f"engine {url}: POST /generate has had no answer for" in caplog.text
    assert "the engine answers /health (alive, busy): still waiting, up to 1.5 s" in caplog.text  # its generation bound


async def test_an_engine_answering_health_but_never_generate_is_stalled_at_its_requests_bound() -> None:
    """Issue 37's drill: the engine answers /health (so the head rule waits), but the generate's answer never
    comes: the generation bound (STALL + 2 tokens × TOKEN) ends it, naming the engine, the wait, the bound and
    how it was derived, far below the read timeout."""
    async with fake_engine(health_but_no_generate) as url:
        error = await stalled(url)
    bound = STALL + 2 * TOKEN
    assert isinstance(error, EngineStalled)
    assert f"engine {url}/generate stalled: POST /generate made no progress for {bound:g} s (no answer within " \
           f"{bound:g} s, the bound of its request: {STALL:g} s + 2 new tokens × {TOKEN:g} s" in str(error)
    assert bound <= error.elapsed < READ / 4


async def test_time_paused_for_a_weight_update_does_not_count_against_the_bound() -> None:
    """The same engine, paused for an update (through the client) while the request waits: the pause is added
    to the bound, and the message says how much of the wait it was."""
    async with fake_engine(health_but_no_generate) as url, client() as c:
        engine = c.engine(url)
        started = anyio.current_time()
        errors: list[EngineError] = []

        async def generate() -> None:
            try:
                await engine.generate(PAYLOAD)
            except EngineStalled as error:
                errors.append(error)

        with anyio.fail_after(READ / 4):
            async with anyio.create_task_group() as group:
                group.start_soon(generate)
                await anyio.sleep(STALL)
                await engine.pause_generation("in_place")
                await anyio.sleep(4 * TOKEN)
                await engine.continue_generation()
    waited = anyio.current_time() - started
    assert len(errors) == 1 and waited >= STALL + 2 * TOKEN + 4 * TOKEN, (errors, waited)
    assert "of it paused for a weight update (not counted)" in str(errors[0])
    assert c.paused_for(url) >= 4 * TOKEN


async def test_without_its_head_watch_a_client_keeps_the_body_rule() -> None:
    """A client nobody runs the watch of (a hook's own) still refuses a dripping reply."""
    async with fake_engine(drip) as url, EngineClient(max_connections=4, stall_timeout=STALL, retry=NO_RETRY) as c:
        with anyio.fail_after(READ / 4), pytest.raises(EngineStalled, match="a reply dripping"):
            await c.engine(url).generate(PAYLOAD)


def test_a_generates_bound_is_derived_from_its_request() -> None:
    c = EngineClient(stall_timeout=10.0, token_timeout=0.5)
    assert c.generation_bound({"sampling_params": {"max_new_tokens": 8}})[0] == 14.0
    assert c.generation_bound({"sampling_params": {"max_new_tokens": 0}})[0] == 10.0  # scoring only: the head's
    assert c.generation_bound({})[0] == 10.0 + 128 * 0.5  # SGLang's default when a request names none
    batch = {"sampling_params": [{"max_new_tokens": 4}, {"max_new_tokens": 64}]}
    bound, derived = c.generation_bound(batch)
    assert bound == 42.0 and derived.startswith("10 s + 64 new tokens × 0.5 s")
