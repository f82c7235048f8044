"""The Tinker futures protocol: every long call answers a request id at once, and `retrieve_future` answers its
result when there is one.

Owns `FutureStore`. A future is pending, done (its body and content type: JSON, or protobuf for the two
results the SDK reads only so) or failed (the SDK's `RequestFailedResponse`: `error`, `category` "user" for
the caller's mistakes, "server" for ours). `retrieve` waits up to `poll_s` for a pending future and then
answers `try_again`, so a client polls without spinning and a server never holds a request for long.
Invariants: at most `max_futures` futures are kept (the oldest finished ones are dropped first; a pending one
never); an unknown request id is a 404 naming it; a future's work is owned by the task that resolves it,
never by the HTTP request that asks for it.
"""

from __future__ import annotations

import itertools
import json
from collections import OrderedDict
from dataclasses import dataclass, field

import anyio

from workers.boundary.http_gates import HttpReply

PROTOBUF = "application/x-protobuf"


class UserError(ValueError):
    """A request the service understood and refuses: the future fails with category "user"."""


@dataclass
class Future:
    request_id: str
    done: anyio.Event = field(default_factory=anyio.Event)
    body: bytes = b""
    content_type: str = "application/json"


class FutureStore:
    def __init__(self, *, max_futures: int = 4096, poll_s: float = 10.0) -> None:
        self.max_futures = max_futures
        self.poll_s = poll_s
        self._futures: OrderedDict[str, Future] = OrderedDict()
        self._ids = itertools.count(1)

    def create(self) -> Future:
        while len(self._futures) >= self.max_futures:
            oldest = next((key for key, f in self._futures.items() if f.done.is_set()), None)
            if oldest is None:
                raise HttpReply(429, f"the service holds {self.max_futures} unfinished futures; retrieve some first")
            del self._futures[oldest]
        future = Future(request_id=f"req-{next(self._ids)}")
        self._futures[future.request_id] = future
        return future

    @staticmethod
    def resolve(future: Future, body: bytes, content_type: str = "application/json") -> None:
        future.body, future.content_type = body, content_type
        future.done.set()

    @staticmethod
    def fail(future: Future, message: str, *, user: bool) -> None:
        FutureStore.resolve(future, json.dumps({"error": message, "category": "user" if user else "server"})
                            .encode())

    async def retrieve(self, request_id: str) -> tuple[bytes, str]:
        future = self._futures.get(request_id)
        if future is None:
            raise HttpReply(404, f"unknown request_id {request_id!r} (never issued here, or dropped: the service "
                            f"keeps the last {self.max_futures} futures)")
        with anyio.move_on_after(self.poll_s):
            await future.done.wait()
        if not future.done.is_set():
            body = {"type": "try_again", "request_id": request_id, "queue_state": "active"}
            return json.dumps(body).encode(), "application/json"
        return future.body, future.content_type

    def pending(self) -> int:
        return sum(not future.done.is_set() for future in self._futures.values())
