"""`send_frame` over real loopback sockets: a frame of parts written to the socket from where they lie arrives whole
and in order, through a peer slower than the sender (the socket fills and drains); bytes a transport still holds
go first; a connection closed while a write waits for a peer that never reads fails the send instead of hanging
it; a peer that goes away fails it with a stream error."""

from __future__ import annotations

import array
import socket
import threading

import anyio
import anyio.abc
import pytest

from coordinator.train.calls import _idle_socket, send_frame
from coordinator.train.connection import STREAM_ERRORS

pytestmark = pytest.mark.anyio


class Peer:
    """The rank's end: a plain blocking socket, read in a thread once `start_reading` is called."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.received = bytearray()
        self._go = threading.Event()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        self._go.wait()
        while chunk := self.sock.recv(7_919):  # small reads: the sender's socket fills and drains many times
            self.received += chunk

    def start_reading(self) -> None:
        self._go.set()

    def finish(self) -> bytes:
        self._thread.join(30)
        assert not self._thread.is_alive()
        self.sock.close()
        return bytes(self.received)


async def connected(rcvbuf: int | None = None) -> tuple[anyio.abc.SocketStream, Peer]:
    async with await anyio.create_tcp_listener(local_host="127.0.0.1") as multi:
        listener = multi.listeners[0]
        port = listener.extra(anyio.abc.SocketAttribute.local_port)
        sock = socket.socket()
        if rcvbuf is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        await anyio.to_thread.run_sync(sock.connect, ("127.0.0.1", port))
        stream = await listener.accept()
    return stream, Peer(sock)  # type: ignore[return-value]


def frame_of_parts() -> list[bytes | bytearray | memoryview]:
    """Over IOV_MAX parts of mixed kinds and sizes, empty ones among them, typed arrays as the codec's are."""
    parts: list[bytes | bytearray | memoryview] = []
    for index in range(1_500):
        if index % 7 == 0:
            parts.append(b"")
        elif index % 3 == 0:
            parts.append(memoryview(array.array("q", range(index, index + 500))))
        elif index % 3 == 1:
            parts.append(bytearray((index + k) % 251 for k in range(index % 97)))
        else:
            parts.append(bytes([index % 256]) * 20_000)
    return parts


async def test_a_frame_of_parts_arrives_whole_through_a_slow_peer() -> None:
    stream, peer = await connected(rcvbuf=4_096)
    parts = frame_of_parts()
    expected = b"".join(bytes(memoryview(part).cast("B")) for part in parts)
    assert len(expected) > 8 << 20  # well over what the two sockets' buffers hold
    async with stream:
        assert _idle_socket(stream) is not None  # written to the socket directly, not through the transport
        peer.start_reading()
        with anyio.fail_after(60):
            await send_frame(stream, parts)
            await send_frame(stream, bytearray(b"tail"))  # a frame of one buffer takes the same path
    assert peer.finish() == expected + b"tail"


async def test_bytes_the_transport_still_holds_go_before_the_frame() -> None:
    stream, peer = await connected(rcvbuf=4_096)
    earlier = bytes(range(256)) * (128 << 10)  # 32 MiB: the transport keeps what the sockets cannot
    async with stream:
        with anyio.move_on_after(0.5):  # the peer does not read: this send cannot finish, its bytes wait
            await stream.send(earlier)
        assert _idle_socket(stream) is None  # so the next frame must queue behind them
        peer.start_reading()
        parts = frame_of_parts()
        with anyio.fail_after(60):
            await send_frame(stream, parts)
    assert peer.finish() == earlier + b"".join(bytes(memoryview(part).cast("B")) for part in parts)


async def test_closing_the_connection_ends_a_write_waiting_on_a_peer_that_never_reads() -> None:
    stream, peer = await connected(rcvbuf=4_096)
    failed: list[BaseException] = []

    async def send() -> None:
        try:
            await send_frame(stream, [bytes(1 << 20)] * 64)
        except STREAM_ERRORS as error:
            failed.append(error)

    with anyio.fail_after(30):
        async with anyio.create_task_group() as group:
            group.start_soon(send)
            await anyio.wait_all_tasks_blocked()  # the write waits: the peer's buffers are full
            assert not failed
            await stream.aclose()  # as the channel closes a lost node's connections
    assert len(failed) == 1 and isinstance(failed[0], anyio.BrokenResourceError)
    peer.sock.close()


async def test_a_peer_that_goes_away_fails_the_send_with_a_stream_error() -> None:
    stream, peer = await connected(rcvbuf=4_096)
    peer.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")  # reset
    peer.sock.close()
    async with stream:
        with anyio.fail_after(30), pytest.raises(STREAM_ERRORS):
            await send_frame(stream, [bytes(1 << 20)] * 64)
