"""One call to the ranks: every rank's frame encoded before any is sent, then every rank's reply gathered.

Owns the encoding of a call's requests (off the event loop), sending each frame in slices (`send_frame`), and the
gathering of its replies. Invariants: a frame over the limit fails the call before any rank was sent a command; a
call never hangs on a rank that answered with an error while the others wait in a collective it never entered
(`error_window_s`); a frame is never copied whole while it is sent.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import anyio
import anyio.abc

from coordinator.train.connection import Call, Pending
from coordinator.train.errors import RankCommandError, RankFailure
from workers import protocol

Frame = bytes | bytearray | list[bytes | bytearray | memoryview]


async def encode_frames(
    requests: dict[int, protocol.Request], max_frame_bytes: int
) -> dict[int, tuple[int, Frame]]:
    """Every rank's (request id, frame), before any is sent: a frame over the limit must not leave some ranks
    with a command. A rollout's shards can be large, so the encoding runs off the event loop. A frame is its
    parts (`encode_frame_parts`): the samples' packed arrays are sent from where they lie."""

    def encode() -> dict[int, tuple[int, Frame]]:
        return {
            rank: (request.request_id, protocol.encode_frame_parts(request, max_frame_bytes))
            for rank, request in requests.items()
        }

    return await anyio.to_thread.run_sync(encode)


#: a frame goes to the transport in slices of this size: asyncio's transport copies what the socket did not take
#: at once, so a whole frame handed over would be held twice while the rank reads it
SEND_CHUNK_BYTES = 1 << 20


async def send_frame(stream: anyio.abc.ByteStream, frame: Frame) -> None:
    """Send one frame in `SEND_CHUNK_BYTES` slices, each waiting for the transport to drain: the coordinator holds
    the frames and at most a slice more, never a second copy of a rollout's command. A frame of parts is sent as
    slices joined from them (one fresh `bytes` each, never changed once handed over: a transport may keep a
    reference to what the socket did not take): no frame-sized buffer, few sends however many parts."""
    if not isinstance(frame, list):
        view = memoryview(frame)
        for offset in range(0, len(view), SEND_CHUNK_BYTES):
            await stream.send(view[offset : offset + SEND_CHUNK_BYTES])  # type: ignore[arg-type]
        return
    pieces: list[memoryview] = []
    size = 0
    for part in frame:
        view = memoryview(part).cast("B")
        offset = 0
        while offset < len(view):
            count = min(len(view) - offset, SEND_CHUNK_BYTES - size)
            pieces.append(view[offset : offset + count])
            size, offset = size + count, offset + count
            if size == SEND_CHUNK_BYTES:
                await stream.send(b"".join(pieces))
                pieces, size = [], 0
    if pieces:
        await stream.send(b"".join(pieces))


async def gather_replies(
    kind: str,
    call: Call,
    pendings: dict[int, Pending],
    *,
    error_window_s: float,
    explain: Callable[[RankFailure], Awaitable[RankFailure]],
) -> dict[int, protocol.Reply]:
    """Each rank's reply once every rank answered (the channel checked its kind). A failure (a rank gone) raises it, explained; a rank's
    error answer raises `RankCommandError` once all answered or `error_window_s` after the first error."""
    error_deadline: float | None = None
    while True:
        changed = call.changed
        failures = [p.failure for p in pendings.values() if p.failure is not None]
        if failures:
            raise await explain(failures[0])
        errors = {
            p.rank: p.response for p in pendings.values() if p.response is not None and not p.response.ok
        }
        if all(p.done for p in pendings.values()) or (
            errors and error_deadline is not None and anyio.current_time() >= error_deadline
        ):
            if errors:
                raise RankCommandError(kind, errors)  # type: ignore[arg-type]
            return {rank: p.response.result for rank, p in pendings.items()}  # type: ignore[union-attr,misc]
        if errors and error_deadline is None:
            # Other ranks may be stuck in a collective the failed rank never entered: wait briefly
            # for their answers (or a disconnect), then report the error rather than hang.
            error_deadline = anyio.current_time() + error_window_s
        if error_deadline is None:
            await changed.wait()
        else:
            with anyio.move_on_after(max(0.0, error_deadline - anyio.current_time())):
                await changed.wait()
