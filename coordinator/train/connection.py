"""One rank's connection to the control channel, and the replies still pending on it.

Owns `RankInfo` (a rank as it introduced itself in Hello), the connection record, the pending reply of one
call and the event that wakes a waiting call. Invariant: a pending reply is resolved once, with a response
or a failure, and resolving it wakes the call that waits on it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import anyio
import anyio.abc

from coordinator.train.errors import RankFailure
from workers import protocol

STREAM_ERRORS = (
    anyio.EndOfStream,
    anyio.IncompleteRead,
    anyio.BrokenResourceError,
    anyio.ClosedResourceError,
    ConnectionError,
    OSError,
)


@dataclass
class RankInfo:
    """A connected rank, as it introduced itself in Hello."""

    rank: int
    world_size: int
    local_rank: int
    pid: int
    restart_count: int
    #: the node whose torchrun started it (multi-node; 0 on a single node)
    node_rank: int = 0

    @property
    def process(self) -> tuple[int, int]:
        """(node, pid): which process this is, whichever torchrun restarted it (train FT tells generations
        apart by it: a rank restarted for a membership change keeps its restart count)."""
        return (self.node_rank, self.pid)

    def describe(self, num_nodes: int = 1) -> str:
        return f"pid {self.pid}" + (f", node {self.node_rank}" if num_nodes > 1 else "")


class Call:
    """Wakes the waiter whenever something it watches changes (a reply resolved, a rank came or went)."""

    def __init__(self) -> None:
        self.changed = anyio.Event()

    def notify(self) -> None:
        self.changed.set()
        self.changed = anyio.Event()


@dataclass
class InFlight:
    """The command the ranks are working on now: its kind, when it was sent, each rank's pending reply
    (read by `coordinator.observe.rank_watch` to name a rank that has not answered)."""

    kind: str
    started: float  # time.monotonic()
    pendings: dict[int, Pending]

    def waiting(self) -> list[int]:
        return sorted(rank for rank, pending in self.pendings.items() if not pending.done)


@dataclass
class Pending:
    """One rank's reply to one request: `expects` is the record its command is answered with."""

    rank: int
    call: Call
    expects: type[protocol.Reply]
    response: protocol.Response | None = None
    failure: RankFailure | None = None

    @property
    def done(self) -> bool:
        return self.response is not None or self.failure is not None

    def resolve(
        self, *, response: protocol.Response | None = None, failure: RankFailure | None = None
    ) -> None:
        if self.done:
            return
        self.response = response
        self.failure = failure
        self.call.notify()


@dataclass
class Connection:
    info: RankInfo
    stream: anyio.abc.ByteStream
    send_lock: anyio.Lock = field(default_factory=anyio.Lock)
    pending: dict[int, Pending] = field(default_factory=dict)
    alive: bool = True
    #: why the coordinator dropped it (its node was lost), when it did
    dropped: str | None = None


def peer_address(stream: anyio.abc.ByteStream) -> str:
    """The remote `host:port` of a connection, for the log ("?" when the transport does not say)."""
    address = stream.extra(anyio.abc.SocketAttribute.remote_address, None)
    if isinstance(address, tuple) and len(address) >= 2:
        return f"{address[0]}:{address[1]}"
    return str(address) if address else "?"
