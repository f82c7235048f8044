"""Connection-level limits uvicorn does not give: a real connection cap, a head limit answered 431, and
idle / head / body deadlines, as a subclass of uvicorn's h11 protocol.

Owns `ServerLimits`, `ConnectionGuard` (one per server: its connections, oldest first) and
`guarded_protocol` (the protocol class uvicorn builds per connection). What uvicorn alone does (0.30-0.54,
read in its source): `limit_concurrency` answers 503 to *requests* once the connection count is reached, so
/health fails too; `h11_max_incomplete_event_size` refuses an oversized head with a 400, not 431;
`timeout_keep_alive` runs only after a response, so a socket that never sends, or sends its head one byte a
second, is held for ever.

Invariants: at most `max_connections` connections live; a new one past the cap closes the oldest idle one
(no request in progress), or is answered 503 and closed at once when every one is busy — never queued, so a
probe gets through while thousands idle; a request head over `max_head_bytes` is a 431; a connection closes
when its first request's first byte does not come within `idle_s` (the next request's within `keep_alive_s`), its
head within `head_s` of that byte, or its body within `body_s` plus one second per `min_body_rate` bytes declared —
measured while the event loop runs: a deadline that fires more than `LATE_S` late (the loop was held up) is judged
again `GRACE_S` later, so a held-up loop never closes a connection whose bytes it has not read, or whose client on
the same loop has not had its turn to write.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

_HEAD_END = re.compile(rb"\r?\n\r?\n")  # h11 ends a head at a blank line, with or without the CR
#: a deadline that fires this late fired after the event loop was held up, not after the peer went quiet
LATE_S = 0.5
#: how long such a deadline waits again, once the loop runs, before it closes the connection
GRACE_S = 1.0


@dataclass(frozen=True)
class ServerLimits:
    """One server's connection limits (defaults for every rayless server; tests and benches shrink them)."""

    max_connections: int = 1024
    max_head_bytes: int = 16 * 1024
    idle_s: float = 5.0
    #: how long a connection is kept open after a response: longer than clients keep pooled connections (httpx
    #: 5 s, aiohttp 15 s), so the server never closes one a client is reusing that instant — the client would see
    #: its request reset (measured: agents' SDK calls failing with ReadError under load); idle kept connections
    #: still make room past the cap
    keep_alive_s: float = 65.0
    head_s: float = 10.0
    body_s: float = 10.0
    min_body_rate: int = 1 << 20  # bytes a second a body may be slower than `body_s` by, per byte declared

    def __post_init__(self) -> None:
        if min(self.max_connections, self.max_head_bytes, self.min_body_rate) < 1 or \
                min(self.idle_s, self.keep_alive_s, self.head_s, self.body_s) <= 0:
            raise ValueError(f"server limits must be positive, not {self}")


class ConnectionGuard:
    """The live connections of one server, oldest first, and what the cap did (counts for logs and tests)."""

    def __init__(self, limits: ServerLimits) -> None:
        self.limits = limits
        self.live: OrderedDict[GuardedH11Protocol, None] = OrderedDict()
        self.evicted = 0
        self.refused = 0
        self.timed_out = 0
        self.head_too_large = 0

    def admit(self, connection: GuardedH11Protocol) -> bool:
        """Take `connection` in; past the cap close the oldest idle one, or refuse this one (False)."""
        if len(self.live) >= self.limits.max_connections:
            victim = next((c for c in self.live if c.idle), None)
            if victim is None:
                self.refused += 1
                return False
            self.evicted += 1
            self.discard(victim)
            victim.transport.close()
        self.live[connection] = None
        return True

    def discard(self, connection: GuardedH11Protocol) -> None:
        self.live.pop(connection, None)


def raw_reply(status: int, reason: str, message: str) -> bytes:
    """A whole `Connection: close` reply in the error shape, for a connection h11 is not answering on."""
    body = json.dumps({"error": {"message": message}}).encode()
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            "connection: close\r\n\r\n").encode() + body


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol under a `ConnectionGuard` (set on the subclass `guarded_protocol` builds)."""

    guard: ConnectionGuard

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._head = bytearray()
        self._timer: asyncio.TimerHandle | None = None
        self._in_body = False
        super().connection_made(transport)
        if not self.guard.admit(self):
            transport.write(raw_reply(503, "Service Unavailable", "the server holds its connection limit "
                                      f"({self.guard.limits.max_connections}), every one busy"))
            transport.close()
            return
        self._arm(self.guard.limits.idle_s, "idle")

    def connection_lost(self, exc: Exception | None) -> None:
        self.guard.discard(self)
        self._disarm()
        super().connection_lost(exc)

    @property
    def idle(self) -> bool:
        """No request in progress: nothing of a head received, no request being answered."""
        return (self.conn.their_state is h11.IDLE and not self._head
                and (self.cycle is None or self.cycle.response_complete))

    def data_received(self, data: bytes) -> None:
        if self.transport.is_closing():
            return
        limits = self.guard.limits
        if self.conn.their_state is h11.IDLE and (self.cycle is None or self.cycle.response_complete):
            if not self._head:
                self._arm(limits.head_s, "head")
            self._head += data
            end = _HEAD_END.search(self._head)
            if (end.end() if end else len(self._head)) > limits.max_head_bytes:
                self.guard.head_too_large += 1
                self._close_with(431, "Request Header Fields Too Large",
                                 f"request head over {limits.max_head_bytes} bytes")
                return
        super().data_received(data)
        self._follow_state()

    def _follow_state(self) -> None:
        state = self.conn.their_state
        if state is h11.IDLE:
            return
        self._head.clear()
        if state is h11.SEND_BODY:
            if not self._in_body:
                self._in_body = True
                declared = dict(self.headers or []).get(b"content-length", b"0")
                size = int(declared) if declared.isdigit() else 0
                self._arm(self.guard.limits.body_s + size / self.guard.limits.min_body_rate, "body")
        else:  # the request is whole (DONE, MUST_CLOSE...): the app runs without a read deadline
            self._in_body = False
            self._disarm()

    def on_response_complete(self) -> None:
        self._in_body = False
        super().on_response_complete()  # arms uvicorn's keep-alive timer (`timeout_keep_alive` = `keep_alive_s`)
        if self.conn.their_state is not h11.IDLE:
            self._follow_state()

    def _arm(self, seconds: float, what: str) -> None:
        self._disarm()
        self._timer = self.loop.call_later(seconds, self._expire, what, self.loop.time() + seconds)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expire(self, what: str, due: float) -> None:
        self._timer = None
        if self.transport.is_closing():
            return
        if self.loop.time() - due > LATE_S:
            # The loop itself was held up (a blocking hook, a starved process): the peer's bytes may have come and
            # not been read yet — or, when the peer is a client on this same loop (an agent calling the session
            # server), not been written yet. Judge again once the loop has run on.
            self._timer = self.loop.call_later(GRACE_S, self._expire, what, self.loop.time() + GRACE_S)
            return
        self.guard.timed_out += 1
        if what == "head":
            self._close_with(408, "Request Timeout", f"request head not complete within {self.guard.limits.head_s:g} s")
        else:  # idle: nothing to answer; body: the app learns of it as a disconnect
            self.transport.close()

    def _close_with(self, status: int, reason: str, message: str) -> None:
        self._disarm()
        self.transport.write(raw_reply(status, reason, message))
        self.transport.close()


def guarded_protocol(guard: ConnectionGuard) -> type[GuardedH11Protocol]:
    """The protocol class of one server (uvicorn builds it with its own arguments, so the guard rides on it)."""
    attributes: dict[str, Any] = {"guard": guard}
    return type("GuardedH11Protocol", (GuardedH11Protocol,), attributes)
