"""Node k's process (k > 0) of a multi-node run: this node's share of the plan, connected back to node 0.

Owns what `rayless train` does on a node other than node 0. It obtains the control token, connects to node 0's
node registry (retrying until node 0 listens, within `START_TIMEOUT_S`) and proves the token, then launches
its share of the placement plan — its torchrun agent, whose ranks dial node 0's control channel, and its
engines, listening on the address this node reaches node 0 from — reports each engine's URL, relaunches one
when node 0 asks, and ends when node 0 says the run is over (exit 0 when it succeeded) or is lost (exit 1).
Nothing here trains, generates or decides: node 0's coordinator does; this process launches, reports and
cleans up. torchrun does the rendezvous and restarts the ranks (train FT) as on node 0.

Invariants: every process launched here is ended on every exit path (shielded); the token reaches the ranks
through their environment only, never a command line or a log; a refused node says why and exits 1.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import TYPE_CHECKING

import anyio
import anyio.abc
from anyio.streams.buffered import BufferedByteReceiveStream

from coordinator.lifecycle.processes import read_tail, wait_exited
from coordinator.nodes import shared, wire
from coordinator.train.connection import STREAM_ERRORS
from workers.errors import RaylessError

if sys.version_info < (3, 11):
    from exceptiongroup import BaseExceptionGroup

if TYPE_CHECKING:
    from coordinator.config import Config
    from coordinator.engines.client import EngineClient
    from coordinator.engines.launch import EngineProcess
    from coordinator.engines.spec import EngineLaunchSpec
    from coordinator.plan import EngineSlot, PlacementPlan
    from coordinator.plan.layout import NodeLayout
    from coordinator.train.torchrun import TorchrunProcess

log = logging.getLogger("rayless")

START_TIMEOUT_S = 300.0
WELCOME_TIMEOUT_S = 120.0


class NodeFailed(RaylessError, RuntimeError):
    """This node cannot go on (refused, node 0 lost, its torchrun failed); the message says which."""


def run_node_sync(config: Config, plan: PlacementPlan) -> int:
    """`rayless train` on node k > 0: exit 0 when node 0 reports the run succeeded, 1 otherwise."""
    from coordinator.lifecycle.failures import log_failure
    from coordinator.lifecycle.logs import setup_logging
    from coordinator.lifecycle.processes import leaf_exceptions

    layout = plan.layout
    assert layout is not None and not layout.is_coordinator
    run_dir = config.logging.resolved_run_dir
    setup_logging(config, run_dir, log_name=f"node{layout.node_rank}.log")
    from coordinator.plan import describe_plan

    (run_dir / f"plan-node{layout.node_rank}.txt").write_text(describe_plan(plan) + "\n")
    log.info("%s", describe_plan(plan, detail=False))
    try:
        outcome = anyio.run(lambda: NodeAgent(config=config, plan=plan, layout=layout).run())
    except KeyboardInterrupt:
        log.error("interrupted; every process launched on this node was stopped")
        return 130
    except BaseExceptionGroup as group:
        for error in leaf_exceptions(group):
            log_failure(log, error)
        return 1
    except Exception as error:
        log_failure(log, error)
        return 1
    if outcome.ok:
        log.info("node %d: the run finished; every process launched here is stopped", layout.node_rank)
        return 0
    log.error("node %d: the coordinator ended the run without success: %s", layout.node_rank,
              outcome.reason or "no reason given")
    return 1


class NodeAgent:
    """This node's share of the plan, launched and reported to node 0. `run()` returns node 0's last word."""

    def __init__(self, *, config: Config, plan: PlacementPlan, layout: NodeLayout) -> None:
        self.config = config
        self.node = plan.local
        self.layout = layout
        self.token = ""
        self.torchrun: TorchrunProcess | None = None
        self.engines: dict[str, EngineProcess] = {}
        self.slots: dict[str, EngineSlot] = {s.name: s for s in (*self.node.rollout_engines, *self.node.eval_engines)}
        self._stream: anyio.abc.ByteStream | None = None
        self._send_lock = anyio.Lock()
        self._watchers: dict[str, anyio.CancelScope] = {}
        self._engine_locks: dict[str, anyio.Lock] = {}

    async def run(self) -> wire.NodeShutdown:
        from coordinator.config.secrets import mask_in_logs
        from coordinator.engines.client import EngineClient

        self.token = await self.layout.token.obtain(create=False, timeout_s=START_TIMEOUT_S)
        mask_in_logs(self.token)
        async with EngineClient(api_key=self.config.sglang.sglang_api_key,
                                admin_api_key=self.config.sglang.sglang_admin_api_key) as client:
            stream = await self._connect()
            self._stream = stream
            try:
                buffered = BufferedByteReceiveStream(stream)
                welcome = await self._handshake(buffered)
                await self._send(wire.SharedDirs(not_shared=shared.unseen(welcome.markers)))
                async with anyio.create_task_group() as tg:
                    tg.start_soon(self._ping)
                    if self.node.ranks is not None:
                        tg.start_soon(self._ranks)
                    for slot in self.slots.values():
                        tg.start_soon(self._first_start, slot, client)
                    outcome = await self._read(buffered, tg, client)
                    tg.cancel_scope.cancel()
                return outcome
            finally:
                with anyio.CancelScope(shield=True):
                    await self._stop_all()
                    await stream.aclose()

    # -- node 0 ------------------------------------------------------------------------------------------------

    async def _connect(self) -> anyio.abc.ByteStream:
        host, port = self.layout.control_host, self.layout.registry_port
        last: BaseException | None = None
        log.info("node %d: connecting to node 0's registry at %s", self.layout.node_rank, self.layout.registry_address)
        with anyio.move_on_after(START_TIMEOUT_S):
            while True:
                try:
                    with anyio.fail_after(10.0):
                        return await anyio.connect_tcp(host, port)
                except (OSError, TimeoutError) as exc:
                    last = exc
                    await anyio.sleep(1.0)
        raise NodeFailed(f"node 0's registry at {self.layout.registry_address} accepted no connection within "
                         f"{START_TIMEOUT_S:.0f} s ({last!r}): is `rayless train` running on node 0, and is the port "
                         "open between the nodes?")

    async def _handshake(self, buffered: BufferedByteReceiveStream) -> wire.NodeWelcome:
        await self._send(wire.NodeHello(version=wire.VERSION, token=self.token, node_rank=self.layout.node_rank,
                                        num_nodes=self.layout.num_nodes, pid=os.getpid(), host=os.uname().nodename))
        try:
            with anyio.fail_after(WELCOME_TIMEOUT_S):
                reply = await wire.receive(buffered)
        except (TimeoutError, *STREAM_ERRORS) as exc:
            raise NodeFailed(f"node 0's registry at {self.layout.registry_address} did not welcome this node "
                             f"({type(exc).__name__})") from None
        if isinstance(reply, wire.NodeRefused):
            raise NodeFailed(f"node 0 refused node {self.layout.node_rank}: {reply.reason}")
        if not isinstance(reply, wire.NodeWelcome):
            raise NodeFailed(f"node 0's registry answered {reply.kind!r} instead of a welcome")
        log.info("node %d: node 0 welcomed this node", self.layout.node_rank)
        return reply

    async def _send(self, message: wire.NodeMessage) -> None:
        assert self._stream is not None
        async with self._send_lock:
            await wire.send(self._stream, message)

    async def _ping(self) -> None:
        while True:
            await anyio.sleep(wire.HEARTBEAT_S)
            await self._send(wire.Ping())

    async def _read(self, buffered: BufferedByteReceiveStream, tg: anyio.abc.TaskGroup,
                    client: EngineClient) -> wire.NodeShutdown:
        where = self.layout.registry_address
        while True:
            try:
                with anyio.fail_after(wire.SILENCE_S):
                    message = await wire.receive(buffered)
            except TimeoutError:
                raise NodeFailed(f"lost node 0 ({where}): silent for {wire.SILENCE_S:g} s") from None
            except STREAM_ERRORS as exc:
                raise NodeFailed(f"lost node 0 ({where}): its connection closed ({type(exc).__name__}) before it "
                                 "said the run was over") from None
            if isinstance(message, wire.NodeShutdown):
                return message
            if isinstance(message, wire.RelaunchEngine):
                if message.name not in self.slots:
                    raise NodeFailed(f"node 0 asked to relaunch {message.name!r:.60}, not an engine of this node")
                tg.start_soon(self._relaunch, message, client)
            elif not isinstance(message, wire.Ping):
                raise NodeFailed(f"node 0 sent {message.kind!r}, which only nodes send")

    # -- this node's processes ---------------------------------------------------------------------------------

    async def _ranks(self) -> None:
        from coordinator.train.group import rank_environment
        from coordinator.train.torchrun import TorchrunProcess

        slot = self.node.ranks
        assert slot is not None
        torchrun = self.torchrun = TorchrunProcess(slot.spec, log_path=slot.log, extra_env=dict(slot.env))
        await torchrun.start(rank_environment(self.layout.control_address, self.token))
        log.info("node %d: torchrun pid %d, %d rank(s); log %s", self.layout.node_rank, torchrun.pid,
                 slot.spec.nproc_per_node, slot.log)
        status = await torchrun.wait_exited()
        await self._send(wire.TorchrunExited(status=status))
        if status != 0:
            raise NodeFailed(f"node {self.layout.node_rank}'s torchrun exited with status {status}; the last lines "
                             f"of {slot.log}:\n{read_tail(slot.log)}")
        log.info("node %d: torchrun exited (its ranks were told to shut down)", self.layout.node_rank)

    def _spec(self, slot: EngineSlot, model_path: str = "", weight_version: str = "") -> EngineLaunchSpec:
        from coordinator.engines.fleet import spec_for_incarnation

        # The plan's host is this node's address on the route to node 0, where node 0 calls the engine.
        return spec_for_incarnation(slot.spec, model_path or None, weight_version or None)

    async def _first_start(self, slot: EngineSlot, client: EngineClient) -> None:
        async with self._engine_locks.setdefault(slot.name, anyio.Lock()):
            process = await self._launch(slot, client, self._spec(slot), port=None)
        if process is not None:
            await self._watch(slot.name, process)

    async def _relaunch(self, message: wire.RelaunchEngine, client: EngineClient) -> None:
        slot = self.slots[message.name]
        async with self._engine_locks.setdefault(slot.name, anyio.Lock()):
            old = self.engines.pop(slot.name, None)
            watcher = self._watchers.pop(slot.name, None)
            if watcher is not None:
                watcher.cancel()  # its exit is this relaunch's doing, not news for node 0
            port = None
            if old is not None:
                port = old.port
                await old.stop()
            log.info("node %d: relaunching engine %s as node 0 asked", self.layout.node_rank, slot.name)
            process = await self._launch(slot, client, self._spec(slot, message.model_path, message.weight_version),
                                         port=port)
        if process is not None:
            await self._watch(slot.name, process)

    async def _launch(self, slot: EngineSlot, client: EngineClient, spec: EngineLaunchSpec, *,
                      port: int | None) -> EngineProcess | None:
        """Start one engine and report it (EngineUp, or EngineFailed and None)."""
        from coordinator.engines.launch import EngineLaunchError, EngineProcess

        process = EngineProcess(spec, name=slot.name, log_path=slot.log, client=client)
        self.engines[slot.name] = process
        try:
            url = await process.start(port=port)
        except EngineLaunchError as exc:
            await self._send(wire.EngineFailed(name=slot.name, error=str(exc)[:4000]))
            return None
        await self._send(wire.EngineUp(name=slot.name, url=url, pid=process.pid or 0))
        return process

    async def _watch(self, name: str, process: EngineProcess) -> None:
        scope = self._watchers[name] = anyio.CancelScope()
        with scope:
            assert process.proc is not None
            status = await wait_exited(process.proc)
            log.warning("node %d: engine %s exited with status %d", self.layout.node_rank, name, status)
            await self._send(wire.EngineExited(name=name, status=status))

    async def _stop_all(self) -> None:
        async with anyio.create_task_group() as tg:
            if self.torchrun is not None:
                tg.start_soon(self.torchrun.stop)
            for process in self.engines.values():
                tg.start_soon(process.stop)
