"""The control-channel server: one authenticated connection per training rank, and the calls made over them.

Owns the accepted connections (their records: `connection`), the handshake check (`Hello` → `Welcome` or a
refusal with its reason, logged with the peer's address), membership (who is connected, who is gone) and the
call lock; one call's frames and replies are `calls`'. It launches nothing: whoever started the ranks tells it
when they are gone (`torchrun_exited`), and lends it `explain`, which adds the ranks' log to a failure.

Invariants:
- Until a peer's token is checked, only its Hello is read, through `protocol.receive_hello` (at most
  `protocol.MAX_HELLO_BYTES`, strictly decoded): a peer without the token cannot make the coordinator read,
  decode or hold more than that, nor stall its event loop. `max_frame_bytes` applies once it is welcomed.
- Calls are serialised (one lock): every rank receives the same commands in the same order, so collectives
  inside a command are always entered by all ranks.
- A call never hangs on a dead rank: a rank that disconnects, or torchrun exiting, fails every pending call at
  once with `RankFailure` naming the rank(s); later calls fail the same way until every rank has reconnected
  (torchrun restarted them: train FT).
- A rank that answers a command with an error makes the call raise `RankCommandError` with its traceback;
  the channel is then marked broken (the ranks may be out of step) and later calls refuse, until every rank
  has reconnected.
"""

from __future__ import annotations

import contextlib
import hmac
import itertools
import logging
import time
from collections.abc import Awaitable, Callable, Collection
from typing import Any

import anyio
import anyio.abc
from anyio.streams.buffered import BufferedByteReceiveStream

from coordinator.train.calls import encode_frames, gather_replies, send_frame
from coordinator.train.connection import (
    STREAM_ERRORS,
    Call,
    Connection,
    InFlight,
    Pending,
    RankInfo,
    peer_address,
)
from coordinator.train.errors import RankCommandError, RankFailure
from workers import protocol

logger = logging.getLogger(__name__)


async def _unchanged(failure: RankFailure) -> RankFailure:
    return failure


class ControlServer:
    """Accepts the ranks' connections (`serve`) and sends them commands (`call`)."""

    def __init__(
        self,
        *,
        world_size: int,
        token: str,
        max_frame_bytes: int = protocol.MAX_FRAME_BYTES,
        handshake_timeout_s: float = 30.0,
        error_window_s: float = 2.0,
        grace_s: float = 5.0,
        explain: Callable[[RankFailure], Awaitable[RankFailure]] | None = None,
        on_connected: Callable[[int], None] | None = None,
        num_nodes: int = 1,
    ) -> None:
        self.world_size = world_size
        #: nodes the ranks run on (multi-node: ranks and refusals are named with their node)
        self.num_nodes = num_nodes
        self.token = token
        self.max_frame_bytes = max_frame_bytes
        self.handshake_timeout_s = handshake_timeout_s
        self.error_window_s = error_window_s
        self.grace_s = grace_s
        #: adds the ranks' log to a failure (the launcher's); failures pass unchanged without one
        self.explain = explain or _unchanged
        #: told how many ranks are connected whenever one says Hello (start-up progress)
        self.on_connected = on_connected
        #: why connections were refused, in order (wrong token, wrong version, bad frame...)
        self.refusals: list[str] = []
        #: torchrun's exit status once it has exited, else None
        self.torchrun_exit_code: int | None = None
        self._connections: dict[int, Connection] = {}
        self._failure: RankFailure | None = None
        self._broken: RankCommandError | None = None
        self._closing = False
        self._call_lock = anyio.Lock()
        self._request_ids = itertools.count(1)
        self._state = Call()
        #: the command in flight (None between calls) and the longest each kind of command has taken so far:
        #: what `coordinator.observe.rank_watch` bounds a wait by
        self.in_flight: InFlight | None = None
        self.longest_s: dict[str, float] = {}

    @property
    def ranks(self) -> dict[int, RankInfo]:
        """The ranks connected now (their pids, as reported in Hello)."""
        return {rank: conn.info for rank, conn in self._connections.items() if conn.alive}

    async def serve(self, listener: anyio.abc.Listener[Any], task_group: anyio.abc.TaskGroup) -> None:
        """Accept connections until cancelled; each connection's handler runs in `task_group`."""
        await listener.serve(self._handle_connection, task_group)

    # ------------------------------------------------------------------------------------- membership

    def _missing(self, ranks: dict[int, RankInfo]) -> list[int]:
        return sorted(set(range(self.world_size)) - set(ranks))

    async def wait_all_connected(self, timeout_s: float) -> None:
        """Return once every rank said Hello; RankFailure (explained) on timeout or torchrun's exit."""
        with anyio.move_on_after(timeout_s):
            if await self._until_connected() is not None:
                return
            ranks = self.ranks
            raise await self.explain(
                RankFailure(
                    self._missing(ranks),
                    f"torchrun exited with code {self.torchrun_exit_code} before all ranks connected "
                    f"({len(ranks)}/{self.world_size})",
                )
            )
        raise await self.explain(
            RankFailure(
                self._missing(self.ranks),
                f"only {len(self.ranks)}/{self.world_size} ranks connected within {timeout_s:g} s "
                f"(refused connections: {self.refusals or 'none'})",
            )
        )

    async def wait_for_ranks(self, *, restarted_after: int | None = None,
                             replacing: Collection[tuple[int, int]] = ()) -> dict[int, RankInfo]:
        """Wait until every rank is connected — with a restart count above `restarted_after` when given, and
        none of them one of the `replacing` processes ((node, pid): a failed generation's), so torchrun
        restarted them. Bound it with a cancel scope; raises RankFailure when torchrun exits first. Calls go
        through again once every rank is back."""
        ranks = await self._until_connected(restarted_after, frozenset(replacing))
        if ranks is not None:
            return ranks
        raise await self.explain(
            RankFailure(
                self._missing(self.ranks) or list(range(self.world_size)),
                f"torchrun exited with code {self.torchrun_exit_code} while waiting for the ranks to reconnect",
            )
        )

    async def _until_connected(self, restarted_after: int | None = None,
                               replacing: frozenset[tuple[int, int]] = frozenset()) -> dict[int, RankInfo] | None:
        """Every rank, once all are connected (each restarted more than `restarted_after` times when given,
        none of the `replacing` processes); None as soon as torchrun has exited instead."""
        while True:
            changed = self._state.changed
            ranks = self.ranks
            if len(ranks) == self.world_size and (
                restarted_after is None
                or all(info.restart_count > restarted_after for info in ranks.values())
            ) and not any(info.process in replacing for info in ranks.values()):
                return ranks
            if self.torchrun_exit_code is not None:
                return None
            await changed.wait()

    def torchrun_exited(self, code: int) -> None:
        """torchrun (and so every rank) is gone: fail what is pending unless we are closing anyway."""
        self.torchrun_exit_code = code
        if not self._closing:
            alive = [rank for rank, conn in self._connections.items() if conn.alive]
            self._fail(
                RankFailure(alive or list(range(self.world_size)), f"torchrun exited with code {code}")
            )
        self._state.notify()

    async def close(self) -> None:
        """Fail pending calls, refuse new ones, and ask every connected rank to shut down. Shield it."""
        # Not under the call lock: a caller may be waiting on a reply that will never come; fail it first.
        self._fail(RankFailure(list(self.ranks), "the training group is shutting down"))
        self._closing = True
        for conn in list(self._connections.values()):
            if conn.alive:
                with contextlib.suppress(*STREAM_ERRORS, protocol.ProtocolError):
                    with anyio.move_on_after(self.grace_s):
                        async with conn.send_lock:
                            request = protocol.Request(next(self._request_ids), protocol.ShutdownCommand())
                            await protocol.send_message(conn.stream, request, self.max_frame_bytes)

    async def drop_node(self, node_rank: int, reason: str) -> list[int]:
        """Close the connections of the ranks on `node_rank` (the node was lost: a rank on a machine that lost
        power sends no FIN); their failure names `reason`. The ranks dropped."""
        dropped = []
        for conn in list(self._connections.values()):
            if conn.alive and conn.info.node_rank == node_rank:
                conn.dropped = reason
                dropped.append(conn.info.rank)
                with contextlib.suppress(*STREAM_ERRORS):
                    await conn.stream.aclose()
        return dropped

    async def disconnect_all(self) -> None:
        """Close every connection (after the ranks' processes have ended)."""
        for conn in self._connections.values():
            conn.alive = False
            with contextlib.suppress(*STREAM_ERRORS):
                await conn.stream.aclose()

    # ------------------------------------------------------------------------------------- connections

    async def _refuse(self, stream: anyio.abc.ByteStream, reason: str) -> None:
        self.refusals.append(reason)
        logger.warning("control channel refused a connection from %s: %s", peer_address(stream), reason)
        with contextlib.suppress(*STREAM_ERRORS, protocol.ProtocolError):
            with anyio.move_on_after(self.handshake_timeout_s):
                await protocol.send_message(stream, protocol.ErrorMessage(reason), self.max_frame_bytes)
        with contextlib.suppress(*STREAM_ERRORS):
            await stream.aclose()

    async def _handle_connection(self, stream: anyio.abc.ByteStream) -> None:
        buffered = BufferedByteReceiveStream(stream)
        try:
            with anyio.fail_after(self.handshake_timeout_s):
                hello = await protocol.receive_hello(buffered)
        except protocol.VersionMismatch as exc:
            await self._refuse(stream, str(exc))
            return
        except protocol.ProtocolError as exc:
            await self._refuse(stream, f"bad handshake frame: {exc}")
            return
        except (TimeoutError, *STREAM_ERRORS) as exc:
            await self._refuse(stream, f"no Hello within {self.handshake_timeout_s} s ({type(exc).__name__})")
            return
        reason = self._check_hello(hello)
        if reason is not None:
            await self._refuse(stream, reason)
            return
        info = RankInfo(hello.rank, hello.world_size, hello.local_rank, hello.pid, hello.restart_count,
                        hello.node_rank)
        conn = Connection(info=info, stream=stream)
        try:
            await protocol.send_message(stream, protocol.Welcome(), self.max_frame_bytes)
        except STREAM_ERRORS:
            with contextlib.suppress(*STREAM_ERRORS):
                await stream.aclose()
            return
        self._connections[hello.rank] = conn
        if self.on_connected is not None:
            self.on_connected(len(self.ranks))
        if len(self.ranks) == self.world_size and (self._failure is not None or self._broken is not None):
            # Every rank is back (torchrun restarted the group): calls may go through again.
            self._failure = None
            self._broken = None
        self._state.notify()
        await self._read_responses(conn, buffered)

    def _check_hello(self, hello: protocol.Hello) -> str | None:
        if not hmac.compare_digest(str(hello.token).encode(), self.token.encode()):
            node = f", node {hello.node_rank}" if self.num_nodes > 1 else ""
            return f"wrong token from rank {hello.rank} (pid {hello.pid}{node}): check {protocol.ENV_TOKEN}"
        if hello.world_size != self.world_size:
            return f"rank {hello.rank} reports world size {hello.world_size}, this group expects {self.world_size}"
        if not 0 <= hello.rank < self.world_size:
            return f"rank {hello.rank} is outside world size {self.world_size}"
        existing = self._connections.get(hello.rank)
        if existing is not None and existing.alive:
            return f"rank {hello.rank} is already connected (pid {existing.info.pid})"
        return None

    async def _read_responses(self, conn: Connection, buffered: BufferedByteReceiveStream) -> None:
        reason = "closed the control channel"
        try:
            while True:
                message = await protocol.receive_message(buffered, self.max_frame_bytes)
                if not isinstance(message, protocol.Response):
                    raise protocol.ProtocolError(f"expected a response, got {message.kind!r}")
                pending = conn.pending.get(message.request_id)
                if pending is None:
                    continue
                if message.ok and not isinstance(message.result, pending.expects):
                    # Left pending: the rank's failure below resolves it (and the call's other ranks).
                    got = "no result" if message.result is None else f"a {message.result.kind!r} reply"
                    raise protocol.ProtocolError(f"answered a {pending.expects.kind!r} command with {got}")
                del conn.pending[message.request_id]
                pending.resolve(response=message)
        except STREAM_ERRORS as exc:
            reason = f"closed the control channel ({type(exc).__name__})"
        except protocol.ProtocolError as exc:
            reason = f"sent an invalid message: {exc}"
        finally:
            if conn.dropped is not None:
                reason = f"is gone: {conn.dropped}"
            was_alive = conn.alive
            conn.alive = False
            with contextlib.suppress(*STREAM_ERRORS):
                await conn.stream.aclose()
            if was_alive and not self._closing:
                info = conn.info
                self._fail(RankFailure([info.rank], f"rank {info.rank} ({info.describe(self.num_nodes)}) {reason}"))
            self._state.notify()

    def _fail(self, failure: RankFailure) -> None:
        if self._failure is None:
            self._failure = failure
        for conn in self._connections.values():
            for pending in list(conn.pending.values()):
                pending.resolve(failure=self._failure)
            conn.pending.clear()

    # ------------------------------------------------------------------------------------------- calls

    async def call_all(self, command: protocol.Command) -> dict[int, protocol.Reply]:
        """The same command to every rank; each rank's reply."""
        return await self.call({rank: command for rank in range(self.world_size)})

    async def call(self, commands: dict[int, protocol.Command]) -> dict[int, protocol.Reply]:
        """Send each rank its command, wait for all replies, each the record its command declares (a rank
        answering another is a failure of that rank); RankFailure / RankCommandError otherwise."""
        async with self._call_lock:
            if self._closing:
                raise RuntimeError("the TrainGroup is shut down (its run() has ended or is ending)")
            if self._failure is not None:
                raise await self.explain(self._failure)
            if self._broken is not None:
                raise RuntimeError(
                    f"the training group is unusable after an earlier failed command: {self._broken}"
                ) from self._broken
            missing = sorted(set(commands) - set(self.ranks))
            if missing:
                raise await self.explain(RankFailure(missing, "not connected"))
            requests = {
                rank: protocol.Request(next(self._request_ids), command) for rank, command in commands.items()
            }
            frames = await encode_frames(requests, self.max_frame_bytes)
            call = Call()
            pendings = {rank: Pending(rank, call, commands[rank].reply) for rank in frames}
            kind = next(iter(commands.values())).kind
            started = time.monotonic()
            # in flight from its first byte: a rank that stops reading a large frame is named and, past its
            # deadline, ended by the rank watch as one that stops answering is (its end fails the send)
            self.in_flight = InFlight(kind, started, pendings)
            try:
                for rank in list(frames):
                    request_id, data = frames.pop(rank)  # each frame released once sent
                    conn = self._connections[rank]
                    pending = conn.pending[request_id] = pendings[rank]
                    try:
                        async with conn.send_lock:
                            await send_frame(conn.stream, data)
                    except STREAM_ERRORS as exc:
                        conn.pending.pop(request_id, None)
                        self._fail(RankFailure([rank], f"rank {rank} could not be sent a command ({exc!r})"))
                        pending.resolve(failure=self._failure)
                replies = await gather_replies(kind, call, pendings, error_window_s=self.error_window_s,
                                               explain=self.explain)
            except RankCommandError as error:
                self._broken = error  # the ranks may be out of step: later calls refuse until all reconnect
                raise
            finally:
                self.in_flight = None
            self.longest_s[kind] = max(self.longest_s.get(kind, 0.0), time.monotonic() - started)
            return replies
