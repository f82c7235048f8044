"""The rank's end of the control channel: one blocking socket to the coordinator, used by one thread.

Owns `RankChannel` (dial, Hello → Welcome, then frames in and out), `HandshakeRefused`, and reading the
channel's settings from the environment torchrun passes on. Invariant: the handshake has a deadline; after
it the channel has none (a training step takes as long as it takes), and a frame over the limit is refused
after its header.
"""

from __future__ import annotations

import os
import socket

from workers.protocol.control import (
    ENV_MAX_FRAME,
    MAX_FRAME_BYTES,
    ControlMessage,
    ErrorMessage,
    Hello,
    Welcome,
    decode_body,
    encode_frame,
)
from workers.protocol.frames import HEADER, ProtocolError, check_length
from workers.protocol.messages import Message


class HandshakeRefused(ProtocolError):
    """The coordinator refused this rank (wrong token, wrong protocol version, unexpected rank)."""


class RankChannel:
    """The rank's end: one blocking socket to the coordinator, used by one thread."""

    def __init__(self, sock: socket.socket, max_frame_bytes: int = MAX_FRAME_BYTES) -> None:
        self.sock = sock
        self.max_frame_bytes = max_frame_bytes

    @classmethod
    def connect(
        cls,
        address: str,
        hello: Hello,
        *,
        timeout_s: float = 60.0,
        max_frame_bytes: int = MAX_FRAME_BYTES,
    ) -> RankChannel:
        """Dial `host:port`, send Hello and wait for Welcome; HandshakeRefused with the coordinator's reason."""
        host, port = split_address(address)
        sock = socket.create_connection((host, port), timeout=timeout_s)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        channel = cls(sock, max_frame_bytes)
        try:
            channel.send(hello)
            reply = channel.receive()
        except ConnectionError as exc:
            sock.close()
            raise HandshakeRefused(
                f"coordinator at {address} closed the connection during the handshake"
            ) from exc
        except BaseException:
            sock.close()
            raise
        if isinstance(reply, ErrorMessage):
            sock.close()
            raise HandshakeRefused(f"coordinator at {address} refused rank {hello.rank}: {reply.message}")
        if not isinstance(reply, Welcome):
            sock.close()
            raise ProtocolError(f"expected welcome from the coordinator, got {reply.kind!r}")
        # Commands can take arbitrarily long (a training step); the channel itself has no deadline.
        sock.settimeout(None)
        return channel

    def send(self, message: ControlMessage) -> None:
        self.sock.sendall(encode_frame(message, self.max_frame_bytes))

    def receive(self) -> Message:
        (length,) = HEADER.unpack(self._receive_exactly(HEADER.size))
        check_length(length, self.max_frame_bytes)
        return decode_body(self._receive_exactly(length))

    def _receive_exactly(self, count: int) -> bytearray:
        """`count` bytes, read into one buffer that is decoded in place (a sample's packed arrays stay views of
        it: a train command is not copied after it arrives)."""
        buffer = bytearray(count)
        view = memoryview(buffer)
        received = 0
        while received < count:
            chunk = self.sock.recv_into(view[received:], count - received)
            if chunk == 0:
                raise ConnectionError("the coordinator closed the control channel")
            received += chunk
        return buffer

    def close(self) -> None:
        self.sock.close()


def split_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"control address {address!r} is not host:port")
    return host.strip("[]"), int(port)


def max_frame_bytes_from_env() -> int:
    value = os.environ.get(ENV_MAX_FRAME)
    if not value:
        return MAX_FRAME_BYTES
    if not value.isdigit() or int(value) <= 0:
        raise ValueError(f"{ENV_MAX_FRAME}={value!r} is not a positive integer")
    return int(value)
