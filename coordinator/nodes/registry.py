"""Node 0's node registry: the other nodes' processes connect here, prove the token and report their engines.

Owns one authenticated connection per node 1..N-1 (`coordinator.nodes.wire`), what each node reported (engine
URLs, its torchrun's exit, which of node 0's directories it sees), the end-of-run word (`NodeShutdown`), and
lost nodes (connection closed, or silent for `wire.SILENCE_S`): their engines are marked dead in every fleet.
It is the engine fleets' `RemoteEngines`. Lost and returning nodes: docs/multi-node.md.

Invariants:
- Before a peer proves the token only its bounded hello is read, within `handshake_timeout_s`; at most
  `max_pending` connections wait for their hello at once (one past it is closed unread, at once); a refused
  peer is named in the log, a flood of them summed up in one line per interval (`refusals.RefusalLog`).
- A node is welcomed only once `before_welcome` returned (node 0's control channel listens); at most one
  connection per node rank.
- With the disk weight sync a node that does not see node 0's run directory ends the run at start-up
  (`NodeSetupError`); a `--save` it does not see is a warning.
"""

from __future__ import annotations

import contextlib
import hmac
import itertools
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import anyio
import anyio.abc
from anyio.abc import SocketAttribute
from anyio.streams.buffered import BufferedByteReceiveStream

from coordinator.engines.errors import EngineError
from coordinator.nodes import shared, wire
from coordinator.nodes.refusals import RefusalLog
from coordinator.plan.layout import NodeLayout
from coordinator.train.connection import STREAM_ERRORS
from workers.errors import RaylessError

if TYPE_CHECKING:
    from coordinator.engines.fleet import EngineFleet

log = logging.getLogger("rayless")


class NodeSetupError(RaylessError, RuntimeError):
    """A node cannot take part in the run as configured (the message names the node and the flag)."""


@dataclass
class _Session:
    node: int
    pid: int
    host: str
    peer: str
    stream: anyio.abc.ByteStream
    send_lock: anyio.Lock = field(default_factory=anyio.Lock)
    scope: anyio.CancelScope = field(default_factory=anyio.CancelScope)
    #: set when a newer connection of the same node replaced it: why
    replaced: str | None = None
    ended: anyio.Event = field(default_factory=anyio.Event)

    async def send(self, message: wire.NodeMessage) -> None:
        async with self.send_lock:
            await wire.send(self.stream, message)


class NodeRegistry:
    """Start with `await task_group.start(registry.run)`; `watch(fleet)` for each fleet with remote engines.

    Args:
        layout: the run's node layout (where to listen, how many nodes).
        token: the control token every node must present.
        engine_nodes: name → node of every engine another node launches.
        shared_dirs: directories every node should see (markers are written there); `disk_sync_dir`, if
            given, is one of them that must be shared (the disk weight sync's snapshots).
        before_welcome: awaited before any node is welcomed (node 0's control channel is listening).
        on_node_lost: awaited with (node, reason) when a node is lost (node 0 drops its ranks' connections).
    """

    def __init__(self, *, layout: NodeLayout, token: str, engine_nodes: Mapping[str, int],
                 shared_dirs: list[Path], disk_sync_dir: Path | None = None, save_dir: Path | None = None,
                 before_welcome: Callable[[], Awaitable[None]] | None = None,
                 on_node_lost: Callable[[int, str], Awaitable[None]] | None = None,
                 handshake_timeout_s: float = 10.0, max_pending: int = 64) -> None:
        self.layout = layout
        self.token = token
        self.engine_nodes = dict(engine_nodes)
        self.shared_dirs = shared_dirs
        self.disk_sync_dir = disk_sync_dir
        self.save_dir = save_dir
        self.before_welcome = before_welcome
        self.on_node_lost = on_node_lost
        self.handshake_timeout_s = handshake_timeout_s
        #: connections that have not proven the token yet, and how many may
        self.pending = 0
        self.max_pending = max_pending
        #: connected nodes now, by node rank
        self.nodes: dict[int, _Session] = {}
        #: each node's address as node 0 sees it (the last connection's), by node rank
        self.hosts: dict[int, str] = {}
        #: why connections were refused: the last 100 in order (`refusal_log.total` counts them all)
        self.refusal_log = RefusalLog()
        #: "joined" / "lost" / "back" events, in order: (node, what, detail)
        self.events: list[tuple[int, str, str]] = []
        self._reports: dict[str, tuple[str, int]] = {}
        self._failed: dict[str, str] = {}
        self._serials = itertools.count(1)
        self._changed = anyio.Event()
        self._fleets: list[EngineFleet] = []
        self._outcome = wire.NodeShutdown(ok=False, reason="the coordinator stopped before the run finished")
        self._markers: list[list[str]] = []

    @property
    def refusals(self) -> list[str]:
        return list(self.refusal_log.recent)

    # -- lifetime ------------------------------------------------------------------------------------------

    def watch(self, fleet: EngineFleet) -> None:
        """Mark `fleet`'s engines of a lost node dead (and those its node reports exited)."""
        self._fleets.append(fleet)

    def finish(self, *, ok: bool, reason: str = "") -> None:
        """What every node is told when the registry stops: the run succeeded (`ok`), or why not."""
        self._outcome = wire.NodeShutdown(ok=ok, reason=reason)

    async def run(self, *, task_status: anyio.abc.TaskStatus[NodeRegistry] = anyio.TASK_STATUS_IGNORED) -> None:
        self._markers = await anyio.to_thread.run_sync(shared.write_markers, self.shared_dirs)
        try:
            try:
                listener = await anyio.create_tcp_listener(local_host=self.layout.control_bind,
                                                           local_port=self.layout.registry_port)
            except OSError as error:
                raise NodeSetupError(
                    f"the node registry cannot listen on {self.layout.control_bind}:{self.layout.registry_port} "
                    f"({error.strerror or error}): every node dials that port; choose another MASTER_PORT or "
                    "--control-port (the registry takes the port after the control channel's)") from None
            async with listener, anyio.create_task_group() as tg:
                await tg.start(self.refusal_log.run)
                tg.start_soon(listener.serve, self._handle, tg)
                log.info("node registry listening on %s:%d for nodes 1..%d", self.layout.control_bind,
                         self.layout.registry_port, self.layout.num_nodes - 1)
                task_status.started(self)
                await anyio.sleep_forever()
        finally:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(shared.remove_markers, self._markers)

    # -- RemoteEngines ---------------------------------------------------------------------------------------

    async def wait_up(self, name: str, *, newer_than: int, timeout: float) -> tuple[str, int]:
        node = self.engine_nodes.get(name)
        if node is None:
            raise ValueError(f"{name} is not an engine of another node")
        with anyio.move_on_after(timeout):
            while True:
                changed = self._changed
                report = self._reports.get(name)
                if report is not None and report[1] > newer_than:
                    return report
                error = self._failed.pop(name, None)
                if error is not None:
                    raise EngineError(f"node {node} could not start engine {name}: {error}", "")
                await changed.wait()
        where = "is not connected" if node not in self.nodes else "is connected but did not report it"
        raise EngineError(f"engine {name}: node {node} did not report it within {timeout:.0f} s (node {node} "
                          f"{where}; is `rayless train` running there with the same flags?)", "")

    async def request_relaunch(self, name: str, *, serial: int, model_path: str | None,
                               weight_version: str | None) -> None:
        node = self.engine_nodes[name]
        report = self._reports.get(name)
        if report is not None and report[1] > serial:
            return  # its node came back and launched it again: nothing to ask
        session = self.nodes.get(node)
        if session is None:
            log.info("engine %s waits for node %d to come back (its node process launches it)", name, node)
            return
        self._failed.pop(name, None)
        await session.send(wire.RelaunchEngine(name=name, model_path=model_path or "",
                                               weight_version=weight_version or ""))

    def node_host(self, node: int) -> str | None:
        """The address node 0 reaches `node` at (node 0: the control host every node dials)."""
        return self.layout.control_host if node == 0 else self.hosts.get(node)

    # -- connections ---------------------------------------------------------------------------------------------

    def _notify(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()

    async def _refuse(self, stream: anyio.abc.ByteStream, peer: str, reason: str, kind: str) -> None:
        self.refusal_log.note(peer, reason, kind=kind)
        with contextlib.suppress(*STREAM_ERRORS, wire.WireError), anyio.move_on_after(self.handshake_timeout_s):
            await wire.send(stream, wire.NodeRefused(reason=reason))
        with contextlib.suppress(*STREAM_ERRORS):
            await stream.aclose()

    def _check(self, hello: wire.NodeHello) -> str | None:
        who = f"node {hello.node_rank} (pid {hello.pid}, host {hello.host!r:.80})"
        if not hmac.compare_digest(hello.token.encode(), self.token.encode()):
            # the peer has proven nothing: it learns no more than that (not even where the token comes from)
            return f"wrong token from {who}: every node needs the same control token"
        if hello.num_nodes != self.layout.num_nodes:
            return f"{who} was started with --actor-num-nodes {hello.num_nodes}, node 0 with {self.layout.num_nodes}"
        if not 0 < hello.node_rank < self.layout.num_nodes:
            return f"{who}: node ranks 1..{self.layout.num_nodes - 1} connect here (node 0 is the coordinator)"
        return None

    async def _handle(self, stream: anyio.abc.ByteStream) -> None:
        peer_address = stream.extra(SocketAttribute.remote_address, ("?", 0))
        peer = f"{peer_address[0]}:{peer_address[1]}" if isinstance(peer_address, tuple) else str(peer_address)
        if self.pending >= self.max_pending:  # a flood: closed unread, so it holds no file for long
            self.refusal_log.note(peer, f"over the {self.max_pending} connections that may await their hello",
                                  kind="over the cap of connections awaiting their hello")
            with contextlib.suppress(*STREAM_ERRORS):
                await stream.aclose()
            return
        self.pending += 1
        try:
            proven = await self._hello(stream, peer)
        finally:
            self.pending -= 1
        if proven is not None:
            await self._welcome(stream, peer, peer_address, proven)

    async def _hello(self, stream: anyio.abc.ByteStream, peer: str
                     ) -> tuple[wire.NodeHello, BufferedByteReceiveStream] | None:
        """The peer's hello once it proved the token; None once it was refused."""
        buffered = BufferedByteReceiveStream(stream)
        try:
            with anyio.fail_after(self.handshake_timeout_s):
                hello = await wire.receive_hello(buffered)
        except wire.WireError as exc:
            await self._refuse(stream, peer, f"bad hello: {exc}", "with a bad hello")
            return None
        except (TimeoutError, *STREAM_ERRORS) as exc:
            await self._refuse(stream, peer, f"no hello within {self.handshake_timeout_s:g} s ({type(exc).__name__})",
                               "without a hello")
            return None
        reason = self._check(hello)
        if reason is not None:
            await self._refuse(stream, peer, reason, "with a hello refused")
            return None
        return hello, buffered

    async def _welcome(self, stream: anyio.abc.ByteStream, peer: str, peer_address: object,
                       proven: tuple[wire.NodeHello, BufferedByteReceiveStream]) -> None:
        hello, buffered = proven
        if self.before_welcome is not None:
            await self.before_welcome()
        old = self.nodes.get(hello.node_rank)
        if old is not None:  # the node's process was started again before its old connection was seen to end
            old.replaced = f"replaced by a new process (pid {hello.pid}) from {peer}"
            old.scope.cancel()
            await old.ended.wait()
        session = _Session(node=hello.node_rank, pid=hello.pid, host=hello.host, peer=peer, stream=stream)
        try:
            await session.send(wire.NodeWelcome(markers=self._markers))
        except STREAM_ERRORS:
            with contextlib.suppress(*STREAM_ERRORS):
                await stream.aclose()
            return
        await self._serve(session, buffered, str(peer_address[0]) if isinstance(peer_address, tuple) else peer)

    async def _serve(self, session: _Session, buffered: BufferedByteReceiveStream, peer_host: str) -> None:
        node = session.node
        back = any(event[0] == node for event in self.events)
        self.nodes[node] = session
        self.hosts[node] = peer_host
        self.events.append((node, "back" if back else "joined", session.peer))
        log.info("node %d %s from %s (host %s, pid %d)", node, "is back" if back else "joined", session.peer,
                 session.host, session.pid)
        lost: str | None = None  # stays None when the registry stops (this task is cancelled)
        try:
            with session.scope:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(self._ping, session)
                    lost = await self._read(session, buffered)
                    tg.cancel_scope.cancel()
            lost = lost or session.replaced
        finally:
            del self.nodes[node]
            with anyio.CancelScope(shield=True), anyio.move_on_after(10.0):
                if lost is not None:
                    await self._lose(session, lost)
                else:  # the run is over: tell the node how it ended
                    with contextlib.suppress(*STREAM_ERRORS, wire.WireError):
                        await session.send(self._outcome)
                with contextlib.suppress(*STREAM_ERRORS):
                    await session.stream.aclose()
            session.ended.set()

    async def _lose(self, session: _Session, reason: str) -> None:
        node = session.node
        self.events.append((node, "lost", reason))
        engines = [name for name, where in self.engine_nodes.items() if where == node]
        log.warning("node %d lost (host %s, pid %d): %s; its training ranks and its engines (%s) are gone until "
                    "the same command runs on node %d again", node, session.host, session.pid, reason,
                    ", ".join(engines) or "none", node)
        for name in engines:
            self._engine_dead(name, f"node {node} lost: {reason}")
        self._notify()
        if self.on_node_lost is not None:
            await self.on_node_lost(node, f"node {node} lost: {reason}")

    def _engine_dead(self, name: str, reason: str) -> None:
        for fleet in self._fleets:
            handle = fleet.find(name)
            if handle is not None:
                fleet.mark_dead(handle, reason)

    async def _ping(self, session: _Session) -> None:
        while True:
            await anyio.sleep(wire.HEARTBEAT_S)
            with contextlib.suppress(*STREAM_ERRORS):
                await session.send(wire.Ping())

    async def _read(self, session: _Session, buffered: BufferedByteReceiveStream) -> str:
        """Handle the node's messages; the reason it is lost once it closes or falls silent."""
        try:
            while True:
                with anyio.fail_after(wire.SILENCE_S):
                    message = await wire.receive(buffered)
                await self._on_message(session, message)
        except TimeoutError:
            return f"silent for {wire.SILENCE_S:g} s (no heartbeat)"
        except STREAM_ERRORS as exc:
            return f"its connection closed ({type(exc).__name__})"
        except wire.WireError as exc:
            return f"it sent an invalid message: {exc}"

    async def _on_message(self, session: _Session, message: wire.NodeMessage) -> None:
        node = session.node
        if isinstance(message, wire.EngineUp | wire.EngineExited | wire.EngineFailed) \
                and self.engine_nodes.get(message.name) != node:
            raise wire.WireError(f"node {node} reports engine {message.name!r:.60}, which the plan does not give it")
        if isinstance(message, wire.EngineUp):
            self._failed.pop(message.name, None)
            self._reports[message.name] = (message.url, next(self._serials))
            log.info("node %d: engine %s answers at %s (pid %d)", node, message.name, message.url, message.pid)
        elif isinstance(message, wire.EngineExited):
            self._engine_dead(message.name, f"its process exited with status {message.status} on node {node}")
        elif isinstance(message, wire.EngineFailed):
            self._failed[message.name] = message.error
            log.warning("node %d could not start engine %s: %s", node, message.name, message.error)
        elif isinstance(message, wire.TorchrunExited):
            level = logging.INFO if message.status == 0 else logging.WARNING
            log.log(level, "node %d: its torchrun exited with status %d", node, message.status)
        elif isinstance(message, wire.SharedDirs):
            self._check_shared(node, message.not_shared)
        elif not isinstance(message, wire.Ping):
            raise wire.WireError(f"node {node} sent {message.kind!r}, which only node 0 sends")
        self._notify()

    def _check_shared(self, node: int, not_shared: list[str]) -> None:
        unseen = {Path(directory) for directory in not_shared}
        if self.disk_sync_dir is not None and self.disk_sync_dir.resolve() in unseen:
            self.finish(ok=False, reason=f"node {node} does not see node 0's run directory {self.disk_sync_dir}")
            raise NodeSetupError(
                f"node {node} does not see node 0's run directory {self.disk_sync_dir} (no filesystem they share "
                "there): the disk weight sync writes the snapshots there for every engine to load; give --run-dir "
                "on a shared filesystem, or use --update-weight-transfer-mode distributed")
        for directory in sorted(unseen):
            what = ("--save" if self.save_dir is not None and directory == self.save_dir.resolve()
                    else "the run directory")
            consequence = ("a checkpoint written by ranks on several nodes cannot be loaded back (train FT, --load)"
                           if what == "--save" else f"node 0 cannot read node {node}'s logs there, and recovering "
                           "its engines loads the current weights from the snapshots there")
            log.warning("node %d does not see %s %s (not a filesystem they share): %s; put it on a shared "
                        "filesystem", node, what, directory, consequence)
        if not unseen:
            log.info("node %d sees node 0's %s (shared)", node,
                     ", ".join(str(d) for d in self.shared_dirs) or "directories")
