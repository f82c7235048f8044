"""The Tinker service's sessions: who is still there, by heartbeat.

Owns `Sessions`. A session is created by a client (`create_session`), kept alive by its heartbeats (the SDK
sends one every 10 s) and ended by `finish` or by silence longer than `timeout_s`; its end stops its training
models (their ranks end) and forgets its sampling sessions. Invariant: a client that disappears leaves nothing
running past `timeout_s` plus one sweep.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import anyio

from workers.boundary.http_gates import HttpReply


@dataclass
class Session:
    session_id: str
    seen: float = field(default_factory=time.monotonic)
    models: list[str] = field(default_factory=list)
    samplers: list[str] = field(default_factory=list)


class Sessions:
    def __init__(self, *, timeout_s: float, on_end: Callable[[Session, str], None], max_sessions: int = 1024) -> None:
        self.timeout_s = timeout_s
        self.on_end = on_end
        self.max_sessions = max_sessions
        self.live: dict[str, Session] = {}
        self.ended: dict[str, str] = {}  # session id → why (heartbeats of an ended session get 410)
        self._ids = itertools.count(1)

    def create(self) -> Session:
        if len(self.live) >= self.max_sessions:
            raise HttpReply(429, f"the service holds its limit of {self.max_sessions} live sessions")
        session = Session(f"session-{next(self._ids)}")
        self.live[session.session_id] = session
        return session

    def get(self, session_id: str) -> Session:
        session = self.live.get(session_id)
        if session is None:
            if session_id in self.ended:
                raise HttpReply(410, f"session {session_id!r} has ended: {self.ended[session_id]}")
            raise HttpReply(404, f"unknown session_id {session_id!r}")
        session.seen = time.monotonic()
        return session

    def end(self, session_id: str, why: str) -> None:
        session = self.live.pop(session_id, None)
        if session is not None:
            self.ended[session_id] = why
            self.on_end(session, why)

    async def sweep(self) -> None:
        """End every session silent for longer than `timeout_s`, every quarter of it."""
        while True:
            await anyio.sleep(self.timeout_s / 4)
            now = time.monotonic()
            for session in [s for s in self.live.values() if now - s.seen > self.timeout_s]:
                self.end(session.session_id, f"no heartbeat for {self.timeout_s:.0f} s (the client is gone)")
