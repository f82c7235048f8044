"""TrainGroup: the coordinator's handle on the torchrun training ranks' lifetime.

Owns the group's lifetime and wires its parts: the control-channel listener and server (`channel`), the
torchrun process (`torchrun`, from the `TorchrunSpec` the group is given whole) and the command API it holds
(`commands`: a `TrainCommands` over the same server, with train FT's `recovery`; batch planning in
`planning`). `run()` binds the
listener, launches torchrun with the token and address in its environment (never on its command line),
signals `started` only once every rank said Hello, and on every exit path — shielded — asks the ranks to shut
down, then ends torchrun's whole process group.

Invariants: the group is usable (`started`) only with every rank connected; every command goes to the ranks
through the server's one lock, so all ranks see the same commands in the same order (see `channel`).
Imports only `workers.protocol` from `workers`, and no torch: the coordinator stays light.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Collection
from pathlib import Path

import anyio
import anyio.abc
from anyio.abc import SocketAttribute

from coordinator.observe.startup import NO_OBSERVER, PhaseObserver
from coordinator.train.channel import ControlServer
from coordinator.train.commands import TrainCommands
from coordinator.train.connection import RankInfo
from coordinator.train.errors import ControlPortError, RankFailure
from coordinator.train.torchrun import TorchrunProcess, TorchrunSpec, torchrun_log_dir
from workers import protocol

logger = logging.getLogger(__name__)


def rank_environment(address: str, token: str, *, max_frame_bytes: int = protocol.MAX_FRAME_BYTES,
                     torch_threads: int = 1) -> dict[str, str]:
    """What each rank needs in its environment to dial the control channel (the placement plan prints it
    with the token masked)."""
    return {
        protocol.ENV_ADDR: address,
        protocol.ENV_TOKEN: token,
        protocol.ENV_MAX_FRAME: str(max_frame_bytes),
        "RAYLESS_TORCH_THREADS": str(torch_threads),
    }


class TrainGroup:
    """Launches the training ranks `spec` describes and holds their command API (`commands`). Use:
    `group = await tg.start(TrainGroup(TorchrunSpec(nproc_per_node=2), run_dir=...).run)`, then
    `group.commands.init(settings)`, `group.commands.train(...)`.

    `launch=False` launches nothing and waits for ranks started elsewhere (`environment()` says what they
    need). `spec.max_restarts > 0` is train FT: torchrun restarts dead ranks, and `commands.train()` brings them
    back to the last checkpoint before sending a step again, at most that many times (`recoveries` counts
    them). `port`: the control channel's port (0: any); unless `port_fixed`, another is taken, with a
    warning, when it is in use. `observer` is told the phases of "train-ranks": starting (torchrun spawned),
    connected n/N (as ranks say Hello), loading (`init`: model and optimizer), ready.
    """

    NAME = TrainCommands.NAME

    def __init__(
        self,
        spec: TorchrunSpec,
        *,
        run_dir: str | Path,
        host: str = "127.0.0.1",
        port: int = 0,
        port_fixed: bool = True,
        advertise_host: str | None = None,
        launch: bool = True,
        token: str | None = None,
        start_timeout_s: float = 300.0,
        handshake_timeout_s: float = 30.0,
        grace_s: float = 5.0,
        error_window_s: float = 2.0,
        max_frame_bytes: int | None = None,
        torch_threads: int = 1,
        extra_env: dict[str, str] | None = None,
        log_name: str = "train_ranks.log",
        observer: PhaseObserver = NO_OBSERVER,
    ) -> None:
        self.spec = spec
        self.world_size = spec.world_size
        self.observer = observer
        self.port_fixed = port_fixed
        self.run_dir = Path(run_dir)
        self.log_path = self.run_dir / log_name
        self.host, self.port, self.advertise_host = host, port, advertise_host
        self.token = token or secrets.token_hex(32)
        self.start_timeout_s = start_timeout_s
        # None: RAYLESS_CONTROL_MAX_FRAME_BYTES or the default, the same limit the ranks read from it
        self.max_frame_bytes = max_frame_bytes or protocol.max_frame_bytes_from_env()
        self.torch_threads = torch_threads
        self.torchrun = (
            TorchrunProcess(
                self.spec,
                log_path=self.log_path,
                grace_s=grace_s,
                torch_threads=torch_threads,
                extra_env=extra_env,
            )
            if launch
            else None
        )
        self.server = ControlServer(
            world_size=self.world_size,
            token=self.token,
            max_frame_bytes=self.max_frame_bytes,
            handshake_timeout_s=handshake_timeout_s,
            error_window_s=error_window_s,
            grace_s=grace_s,
            explain=self.torchrun.explain if self.torchrun is not None else None,
            on_connected=self._connected,
            num_nodes=spec.nnodes,
        )
        self.commands = TrainCommands(self.server, observer=observer, max_restarts=spec.max_restarts)
        self.address: str | None = None
        # Set once the listener is bound (`address` known) and once every rank has said Hello.
        self.listening = anyio.Event()
        self.ready = anyio.Event()
        self._stop = anyio.Event()

    # ------------------------------------------------------------------------------------------ lifetime

    @property
    def ranks(self) -> dict[int, RankInfo]:
        """The ranks connected now (their pids, as reported in Hello)."""
        return self.server.ranks

    @property
    def refusals(self) -> list[str]:
        """Why connections to the control channel were refused, in order."""
        return self.server.refusals

    @property
    def torchrun_pid(self) -> int | None:
        return self.torchrun.pid if self.torchrun is not None else None

    @property
    def recoveries(self) -> int:
        """Train FT recoveries made so far (0 without train FT)."""
        return self.commands.recoveries

    async def run(self, *, task_status: anyio.abc.TaskStatus[TrainGroup] = anyio.TASK_STATUS_IGNORED) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        listener = await self._listen()
        async with listener:
            self.address = f"{self.advertise_host or self.host}:{listener.extra(SocketAttribute.local_port)}"
            self.listening.set()
            startup_failure: RankFailure | None = None
            # The connections outlive a cancellation of run() until the teardown has sent the ranks their
            # shutdown command and torchrun has exited: cancelled with the rest, they would close first, and
            # every rank would end on "lost the control channel" (a ChildFailedError in train_ranks.log).
            connections = anyio.CancelScope(shield=True)
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._serve, listener, connections)
                try:
                    await self._launch(tg)
                    try:
                        await self.server.wait_all_connected(self.start_timeout_s)
                    except RankFailure as exc:
                        # Raised below, outside the task group, so the caller of tg.start() gets a
                        # RankFailure rather than an ExceptionGroup around it.
                        startup_failure = exc
                        self.observer.phase(self.NAME, "failed", exc.reason)
                    else:
                        self.ready.set()
                        task_status.started(self)
                        await self._stop.wait()
                finally:
                    with anyio.CancelScope(shield=True):
                        await self._teardown()
                    connections.cancel()
                    tg.cancel_scope.cancel()
        if startup_failure is not None:
            raise startup_failure

    async def _serve(self, listener: anyio.abc.SocketListener, scope: anyio.CancelScope) -> None:
        """Accept and serve the ranks' connections inside `scope` (shielded; run()'s teardown cancels it)."""
        with scope:
            async with anyio.create_task_group() as handlers:
                await self.server.serve(listener, handlers)

    async def _listen(self) -> anyio.abc.SocketListener:
        """The control channel's listener on the planned port, or (not fixed, in use) on another."""
        try:
            return await anyio.create_tcp_listener(local_host=self.host, local_port=self.port)
        except OSError as error:
            if self.port_fixed or self.port == 0:
                raise ControlPortError(
                    f"the control channel cannot listen on {self.host}:{self.port} ({error.strerror or error}): "
                    "pass another --control-port, or 0 for any free port") from error
            listener = await anyio.create_tcp_listener(local_host=self.host, local_port=0)
            logger.warning("control channel: planned port %d on %s is in use (%s); listening on port %d instead",
                           self.port, self.host, error.strerror or error,
                           listener.extra(SocketAttribute.local_port))
            return listener

    def _connected(self, connected: int) -> None:
        if connected == self.world_size and self.commands.settings is not None:
            self.observer.phase(self.NAME, "ready", "every rank is back")  # after a restart (train FT)
        else:
            self.observer.phase(self.NAME, f"connected {connected}/{self.world_size}")

    async def _launch(self, tg: anyio.abc.TaskGroup) -> None:
        if self.torchrun is None:
            logger.info(
                "waiting for %d external ranks to dial %s (token via %s)",
                self.world_size,
                self.address,
                protocol.ENV_TOKEN,
            )
            return
        await self.torchrun.start(self.environment())
        self.observer.phase(self.NAME, "starting", f"torchrun pid {self.torchrun.pid}, {self.world_size} rank(s)")
        tg.start_soon(self._watch_torchrun, self.torchrun)

    async def _watch_torchrun(self, torchrun: TorchrunProcess) -> None:
        self.server.torchrun_exited(await torchrun.wait_exited())

    def environment(self) -> dict[str, str]:
        """What each rank needs in its environment (also for ranks started by an external launcher)."""
        if self.address is None:
            raise RuntimeError("TrainGroup.environment() is known only after run() bound the listener")
        return rank_environment(self.address, self.token, max_frame_bytes=self.max_frame_bytes,
                                torch_threads=self.torch_threads)

    def torchrun_command(self) -> list[str]:
        return self.spec.command(log_dir=torchrun_log_dir(self.log_path))

    async def wait_for_ranks(self, *, restarted_after: int | None = None,
                             replacing: Collection[tuple[int, int]] = ()) -> dict[int, RankInfo]:
        """Wait until every rank is connected (see `ControlServer.wait_for_ranks`)."""
        return await self.server.wait_for_ranks(restarted_after=restarted_after, replacing=replacing)

    async def finish(self, *, within: float) -> None:
        """The end of a run that ended by itself: ask the ranks to exit and wait, up to `within` seconds and
        cancellably (a stop signal still ends the run within its bound), for torchrun's clean exit; run()'s
        teardown then finds it gone instead of signalling it after the short grace."""
        with anyio.CancelScope(shield=True):
            await self.server.close()
        if self.torchrun is not None and self.torchrun.proc is not None:
            with anyio.move_on_after(within):
                await self.torchrun.wait_exited()

    async def shutdown(self) -> None:
        """Ask the ranks to exit, wait for torchrun, and let run() return."""
        with anyio.CancelScope(shield=True):
            await self._teardown()
        self._stop.set()

    async def _teardown(self) -> None:
        await self.server.close()
        self._stop.set()
        if self.torchrun is not None:
            await self.torchrun.stop()
        await self.server.disconnect_all()
