"""Raw client sockets for the server-limit tests and bench: many idle connections, and one-shot raw requests.

Owns `open_idle` (`n` connections that send nothing; the caller closes them with `close_all` in a `finally`),
`raw_exchange` (bytes out, the reply's bytes back until the server closes or `timeout`) and `closed_by_peer`.
Invariant: a socket opened here is closed by its call, or handed to a caller that closes it, on every path.
"""

from __future__ import annotations

import socket


def open_idle(host: str, port: int, n: int) -> list[socket.socket]:
    """`n` connected sockets that send nothing (blocking connects: on loopback, microseconds each; run it in
    a thread from async code)."""
    held: list[socket.socket] = []
    try:
        for _ in range(n):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            held.append(sock)
            sock.connect((host, port))
    except BaseException:
        close_all(held)
        raise
    return held


def close_all(held: list[socket.socket]) -> None:
    for sock in held:
        sock.close()


def raw_exchange(host: str, port: int, data: bytes, *, timeout: float = 30.0) -> bytes:
    """Send `data`, read until the server closes: the reply's bytes. AssertionError when the server is still
    holding the connection after `timeout` seconds of silence."""
    with socket.create_connection((host, port), timeout=timeout) as sock:
        if data:
            sock.sendall(data)
        chunks = []
        while True:
            try:
                chunk = sock.recv(65536)
            except ConnectionResetError:
                break
            except TimeoutError:
                raise AssertionError(f"the server held the connection {timeout:g} s without closing it") from None
            if not chunk:
                break
            chunks.append(chunk)
        return b"".join(chunks)


def first_reply(host: str, port: int, data: bytes, *, timeout: float = 30.0) -> bytes:
    """Send `data` (a request head whose body never follows) and return the first bytes of the answer, without
    waiting for the server to close."""
    with socket.create_connection((host, port), timeout=timeout) as sock:
        sock.sendall(data)
        return sock.recv(65536)


def closed_by_peer(sock: socket.socket) -> bool:
    """True once the server closed `sock` (reads reach EOF or a reset, after any reply); never blocks."""
    sock.setblocking(False)
    try:
        while sock.recv(65536):
            pass
        return True
    except BlockingIOError:
        return False
    except (ConnectionResetError, OSError):
        return True
