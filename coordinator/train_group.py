"""TrainGroup: the coordinator's handle on the torchrun training ranks.

Owns the control-channel listener, the torchrun child process (its own process group, logs in the run
directory) and one connection per rank. `run()` binds the listener, launches torchrun with the token and
address in its environment (never on its command line), signals `started` once every rank said Hello,
and on every exit path asks the ranks to shut down, then terminates torchrun's whole process group
(SIGTERM, then SIGKILL after a grace period).

Invariants:
- Commands are serialised (`_call_lock`): every rank receives the same commands in the same order, so
  collectives inside a command are always entered by all ranks.
- A call never hangs on a dead rank: a rank that disconnects, or torchrun exiting, fails every pending
  call at once with `RankFailure` naming the rank(s) and the tail of the log; later calls fail the same
  way until every rank has reconnected (torchrun restarts, train FT).
- A rank that answers a command with an error makes the call raise `RankCommandError` with its
  traceback; the group is then marked broken (the ranks may be out of step), and later calls refuse.

Imports only `workers.protocol` from `workers`, and no torch: the coordinator stays light.
"""

from __future__ import annotations

import contextlib
import hmac
import itertools
import logging
import os
import secrets
import signal
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import anyio
import anyio.abc
from anyio.abc import SocketAttribute
from anyio.streams.buffered import BufferedByteReceiveStream

from workers import protocol

logger = logging.getLogger(__name__)

_STREAM_ERRORS = (
    anyio.EndOfStream,
    anyio.IncompleteRead,
    anyio.BrokenResourceError,
    anyio.ClosedResourceError,
    ConnectionError,
    OSError,
)


class RankFailure(RuntimeError):
    """One or more training ranks died or disconnected (or torchrun exited)."""

    def __init__(
        self, ranks: Sequence[int], reason: str, *, log_path: Path | None = None, log_tail: str = ""
    ) -> None:
        self.ranks = sorted(set(ranks))
        self.reason = reason
        self.log_path = log_path
        self.log_tail = log_tail
        names = ", ".join(str(rank) for rank in self.ranks) or "unknown"
        message = f"training rank(s) {names} failed: {reason}"
        if log_tail:
            message += f"\n--- last lines of {log_path} ---\n{log_tail}"
        super().__init__(message)


class RankCommandError(RuntimeError):
    """A rank answered a command with an error (its traceback is in the message)."""

    def __init__(self, command: str, errors: dict[int, protocol.Response]) -> None:
        self.command = command
        self.errors = errors
        first_rank = min(errors)
        first = errors[first_rank]
        ranks = ", ".join(str(rank) for rank in sorted(errors))
        super().__init__(
            f"command {command!r} failed on rank(s) {ranks}: {first.error}\n--- rank {first_rank} traceback ---\n"
            f"{first.traceback}"
        )


@dataclass
class RankInfo:
    rank: int
    world_size: int
    local_rank: int
    pid: int
    restart_count: int


@dataclass
class CheckpointInfo:
    rollout_id: int
    extra: dict[str, Any]
    path: Path


@dataclass
class _Pending:
    rank: int
    call: _Call
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


class _Call:
    """Wakes the caller whenever one of its pending replies resolves."""

    def __init__(self) -> None:
        self.changed = anyio.Event()

    def notify(self) -> None:
        self.changed.set()
        self.changed = anyio.Event()


@dataclass
class _Connection:
    info: RankInfo
    stream: anyio.abc.ByteStream
    send_lock: anyio.Lock = field(default_factory=anyio.Lock)
    pending: dict[int, _Pending] = field(default_factory=dict)
    alive: bool = True


class TrainGroup:
    """Launches and talks to the training ranks. Use: `group = await tg.start(TrainGroup(...).run)`."""

    def __init__(
        self,
        *,
        nproc_per_node: int,
        run_dir: str | Path,
        nnodes: int = 1,
        node_rank: int | None = None,
        rdzv_backend: str | None = None,
        rdzv_endpoint: str | None = None,
        max_restarts: int = 0,
        host: str = "127.0.0.1",
        port: int = 0,
        advertise_host: str | None = None,
        launch: bool = True,
        token: str | None = None,
        start_timeout_s: float = 300.0,
        handshake_timeout_s: float = 30.0,
        grace_s: float = 5.0,
        error_window_s: float = 2.0,
        max_frame_bytes: int = protocol.MAX_FRAME_BYTES,
        torch_threads: int = 1,
        extra_env: dict[str, str] | None = None,
        log_name: str = "train_ranks.log",
    ) -> None:
        if nproc_per_node < 1 or nnodes < 1:
            raise ValueError(f"nproc_per_node ({nproc_per_node}) and nnodes ({nnodes}) must be >= 1")
        if nnodes > 1 and not rdzv_endpoint:
            raise ValueError("a multi-node TrainGroup (nnodes > 1) needs rdzv_endpoint (host:port)")
        self.nproc_per_node = nproc_per_node
        self.nnodes = nnodes
        self.node_rank = node_rank
        self.rdzv_backend = rdzv_backend
        self.rdzv_endpoint = rdzv_endpoint
        self.max_restarts = max_restarts
        self.world_size = nproc_per_node * nnodes
        self.run_dir = Path(run_dir)
        self.host = host
        self.port = port
        self.advertise_host = advertise_host
        self.launch = launch
        self.token = token or secrets.token_hex(32)
        self.start_timeout_s = start_timeout_s
        self.handshake_timeout_s = handshake_timeout_s
        self.grace_s = grace_s
        self.error_window_s = error_window_s
        self.max_frame_bytes = max_frame_bytes
        self.torch_threads = torch_threads
        self.extra_env = dict(extra_env or {})
        self.log_path = self.run_dir / log_name

        self.address: str | None = None
        self.refusals: list[str] = []
        self.train_config: dict[str, Any] | None = None
        self.step_metrics: list[dict[str, float]] = []
        self._connections: dict[int, _Connection] = {}
        self._process: anyio.abc.Process | None = None
        self._exit_code: int | None = None
        self._failure: RankFailure | None = None
        self._broken: RankCommandError | None = None
        self._call_lock = anyio.Lock()
        self._request_ids = itertools.count(1)
        self._state = _Call()
        self._stop = anyio.Event()
        # Set once the listener is bound (`address` known) and once every rank has said Hello.
        self.listening = anyio.Event()
        self.ready = anyio.Event()

    # ------------------------------------------------------------------------------------------ lifetime

    @property
    def ranks(self) -> dict[int, RankInfo]:
        """The ranks connected now (their pids, as reported in Hello)."""
        return {rank: conn.info for rank, conn in self._connections.items() if conn.alive}

    @property
    def torchrun_pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    async def run(self, *, task_status: anyio.abc.TaskStatus[TrainGroup] = anyio.TASK_STATUS_IGNORED) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        listener = await anyio.create_tcp_listener(local_host=self.host, local_port=self.port)
        async with listener:
            port = listener.extra(SocketAttribute.local_port)
            self.address = f"{self.advertise_host or self.host}:{port}"
            self.listening.set()
            log_file: IO[bytes] | None = None
            startup_failure: RankFailure | None = None
            try:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(listener.serve, self._handle_connection, tg)
                    try:
                        if self.launch:
                            # The child writes to this file directly; it is closed in the finally below.
                            log_file = await anyio.to_thread.run_sync(open, self.log_path, "ab")
                            self._process = await self._launch(log_file)
                            tg.start_soon(self._watch_process, self._process)
                        else:
                            logger.info(
                                "waiting for %d external ranks to dial %s (token via %s)",
                                self.world_size,
                                self.address,
                                protocol.ENV_TOKEN,
                            )
                        try:
                            await self._wait_all_connected()
                        except RankFailure as exc:
                            # Raised below, outside the task group, so the caller of tg.start() gets a
                            # RankFailure rather than an ExceptionGroup around it.
                            startup_failure = exc
                        else:
                            self.ready.set()
                            task_status.started(self)
                            await self._stop.wait()
                    finally:
                        with anyio.CancelScope(shield=True):
                            await self._teardown()
                        tg.cancel_scope.cancel()
            finally:
                if log_file is not None:
                    log_file.close()
        if startup_failure is not None:
            raise startup_failure

    def environment(self) -> dict[str, str]:
        """What each rank needs in its environment (also for ranks started by an external launcher)."""
        if self.address is None:
            raise RuntimeError("TrainGroup.environment() is known only after run() bound the listener")
        return {
            protocol.ENV_ADDR: self.address,
            protocol.ENV_TOKEN: self.token,
            protocol.ENV_MAX_FRAME: str(self.max_frame_bytes),
            "RAYLESS_TORCH_THREADS": str(self.torch_threads),
        }

    def torchrun_command(self) -> list[str]:
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            str(self.nproc_per_node),
        ]
        if self.nnodes > 1 or self.rdzv_endpoint:
            command += ["--nnodes", str(self.nnodes)]
            if self.node_rank is not None:
                command += ["--node-rank", str(self.node_rank)]
            command += [
                "--rdzv-backend",
                self.rdzv_backend or "c10d",
                "--rdzv-endpoint",
                str(self.rdzv_endpoint),
            ]
        else:
            # A private rendezvous on a free port: several groups (tests, evals) can run side by side.
            command += ["--standalone"]
        command += ["--max-restarts", str(self.max_restarts), "-m", "workers.train_rank"]
        return command

    async def _launch(self, log_file: IO[bytes]) -> anyio.abc.Process:
        # extra_env may tune the ranks (threads, frame limit) but never replace the address or the token.
        env = {**os.environ, **self.environment(), **self.extra_env}
        env.update({key: self.environment()[key] for key in (protocol.ENV_ADDR, protocol.ENV_TOKEN)})
        env.setdefault("OMP_NUM_THREADS", str(self.torch_threads))
        command = self.torchrun_command()
        log_file.write(f"$ {' '.join(command)}\n".encode())
        log_file.flush()
        return await anyio.open_process(
            command,
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )

    async def _watch_process(self, process: anyio.abc.Process) -> None:
        code = await process.wait()
        self._exit_code = code
        if not self._stop.is_set():
            self._fail(
                RankFailure(
                    [rank for rank, conn in self._connections.items() if conn.alive]
                    or list(range(self.world_size)),
                    f"torchrun exited with code {code}",
                    log_path=self.log_path,
                )
            )
        self._state.notify()

    async def _wait_all_connected(self) -> None:
        with anyio.move_on_after(self.start_timeout_s):
            await self._wait_all_connected_forever()
            return
        raise await self._with_log(
            RankFailure(
                sorted(set(range(self.world_size)) - set(self.ranks)),
                f"only {len(self.ranks)}/{self.world_size} ranks connected within {self.start_timeout_s:g} s "
                f"(refused connections: {self.refusals or 'none'})",
                log_path=self.log_path,
            )
        )

    async def _wait_all_connected_forever(self) -> None:
        while True:
            changed = self._state.changed
            if len(self.ranks) == self.world_size:
                return
            if self._exit_code is not None:
                raise await self._with_log(
                    RankFailure(
                        sorted(set(range(self.world_size)) - set(self.ranks)),
                        f"torchrun exited with code {self._exit_code} before all ranks connected "
                        f"({len(self.ranks)}/{self.world_size})",
                        log_path=self.log_path,
                    )
                )
            await changed.wait()

    async def wait_for_ranks(self, *, restarted_after: int | None = None) -> dict[int, RankInfo]:
        """Wait until every rank is connected — with a restart count above `restarted_after` when given
        (torchrun restarted them after a failure). Bound it with a cancel scope; raises RankFailure when
        torchrun exits first. Calls go through again once every rank is back."""
        while True:
            changed = self._state.changed
            ranks = self.ranks
            if len(ranks) == self.world_size and (
                restarted_after is None
                or all(info.restart_count > restarted_after for info in ranks.values())
            ):
                return ranks
            if self._exit_code is not None:
                raise await self._with_log(
                    RankFailure(
                        sorted(set(range(self.world_size)) - set(ranks)) or list(range(self.world_size)),
                        f"torchrun exited with code {self._exit_code} while waiting for the ranks to reconnect",
                        log_path=self.log_path,
                    )
                )
            await changed.wait()

    async def shutdown(self) -> None:
        """Ask the ranks to exit, wait for torchrun, and let run() return."""
        with anyio.CancelScope(shield=True):
            await self._teardown()
        self._stop.set()

    async def _teardown(self) -> None:
        # Not under _call_lock: a caller may be waiting on a reply that will never come; fail it first.
        self._fail(
            RankFailure(list(self.ranks), "the training group is shutting down", log_path=self.log_path)
        )
        self._stop.set()
        for conn in list(self._connections.values()):
            if conn.alive:
                with contextlib.suppress(*_STREAM_ERRORS, protocol.ProtocolError):
                    with anyio.move_on_after(self.grace_s):
                        async with conn.send_lock:
                            request = protocol.Request(next(self._request_ids), protocol.ShutdownCommand())
                            await protocol.send_message(conn.stream, request, self.max_frame_bytes)
        process = self._process
        if process is not None and process.returncode is None:
            with anyio.move_on_after(self.grace_s):
                await process.wait()
            for sig in (signal.SIGTERM, signal.SIGKILL):
                if process.returncode is not None:
                    break
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(process.pid, sig)
                with anyio.move_on_after(self.grace_s):
                    await process.wait()
        if process is not None and process.returncode is None:
            await process.wait()
        for conn in self._connections.values():
            conn.alive = False
            with contextlib.suppress(*_STREAM_ERRORS):
                await conn.stream.aclose()

    # --------------------------------------------------------------------------------------- connections

    async def _refuse(self, stream: anyio.abc.ByteStream, reason: str) -> None:
        self.refusals.append(reason)
        logger.warning("control channel refused a connection: %s", reason)
        with contextlib.suppress(*_STREAM_ERRORS, protocol.ProtocolError):
            with anyio.move_on_after(self.handshake_timeout_s):
                await protocol.send_message(stream, protocol.ErrorMessage(reason), self.max_frame_bytes)
        with contextlib.suppress(*_STREAM_ERRORS):
            await stream.aclose()

    async def _handle_connection(self, stream: anyio.abc.ByteStream) -> None:
        buffered = BufferedByteReceiveStream(stream)
        try:
            with anyio.fail_after(self.handshake_timeout_s):
                hello = await protocol.receive_message(buffered, self.max_frame_bytes)
        except protocol.ProtocolError as exc:
            await self._refuse(stream, f"bad handshake frame: {exc}")
            return
        except (TimeoutError, *_STREAM_ERRORS) as exc:
            await self._refuse(stream, f"no Hello within {self.handshake_timeout_s} s ({type(exc).__name__})")
            return
        reason = self._check_hello(hello)
        if reason is not None:
            await self._refuse(stream, reason)
            return
        assert isinstance(hello, protocol.Hello)
        info = RankInfo(hello.rank, hello.world_size, hello.local_rank, hello.pid, hello.restart_count)
        conn = _Connection(info=info, stream=stream)
        try:
            await protocol.send_message(stream, protocol.Welcome(), self.max_frame_bytes)
        except _STREAM_ERRORS:
            with contextlib.suppress(*_STREAM_ERRORS):
                await stream.aclose()
            return
        self._connections[hello.rank] = conn
        if len(self.ranks) == self.world_size and (self._failure is not None or self._broken is not None):
            # Every rank is back (torchrun restarted the group): calls may go through again.
            self._failure = None
            self._broken = None
        self._state.notify()
        await self._read_responses(conn, buffered)

    def _check_hello(self, hello: protocol.Message) -> str | None:
        if not isinstance(hello, protocol.Hello):
            return f"expected hello as the first message, got {hello.kind!r}"
        if hello.protocol_version != protocol.PROTOCOL_VERSION:
            return (
                f"protocol version mismatch: rank speaks {hello.protocol_version}, coordinator speaks "
                f"{protocol.PROTOCOL_VERSION}; run the same rayless version on both sides"
            )
        if not hmac.compare_digest(str(hello.token).encode(), self.token.encode()):
            return f"wrong token from rank {hello.rank} (pid {hello.pid}): check {protocol.ENV_TOKEN}"
        if hello.world_size != self.world_size:
            return f"rank {hello.rank} reports world size {hello.world_size}, this group expects {self.world_size}"
        if not 0 <= hello.rank < self.world_size:
            return f"rank {hello.rank} is outside world size {self.world_size}"
        existing = self._connections.get(hello.rank)
        if existing is not None and existing.alive:
            return f"rank {hello.rank} is already connected (pid {existing.info.pid})"
        return None

    async def _read_responses(self, conn: _Connection, buffered: BufferedByteReceiveStream) -> None:
        reason = "closed the control channel"
        try:
            while True:
                message = await protocol.receive_message(buffered, self.max_frame_bytes)
                if not isinstance(message, protocol.Response):
                    raise protocol.ProtocolError(f"expected a response, got {message.kind!r}")
                pending = conn.pending.pop(message.request_id, None)
                if pending is not None:
                    pending.resolve(response=message)
        except _STREAM_ERRORS as exc:
            reason = f"closed the control channel ({type(exc).__name__})"
        except protocol.ProtocolError as exc:
            reason = f"sent an invalid message: {exc}"
        finally:
            was_alive = conn.alive
            conn.alive = False
            with contextlib.suppress(*_STREAM_ERRORS):
                await conn.stream.aclose()
            if was_alive and not self._stop.is_set():
                info = conn.info
                self._fail(
                    RankFailure(
                        [info.rank], f"rank {info.rank} (pid {info.pid}) {reason}", log_path=self.log_path
                    )
                )
            self._state.notify()

    def _fail(self, failure: RankFailure) -> None:
        if self._failure is None:
            self._failure = failure
        for conn in self._connections.values():
            for pending in list(conn.pending.values()):
                pending.resolve(failure=self._failure)
            conn.pending.clear()

    # -------------------------------------------------------------------------------------------- calls

    async def _call(self, commands: dict[int, protocol.Command]) -> dict[int, dict[str, Any]]:
        """Send each rank its command, wait for all replies; RankFailure / RankCommandError otherwise."""
        async with self._call_lock:
            if self._stop.is_set():
                raise RuntimeError("the TrainGroup is shut down (its run() has ended or is ending)")
            if self._failure is not None:
                raise await self._with_log(self._failure)
            if self._broken is not None:
                raise RuntimeError(
                    f"the training group is unusable after an earlier failed command: {self._broken}"
                ) from self._broken
            missing = sorted(set(commands) - set(self.ranks))
            if missing:
                raise await self._with_log(RankFailure(missing, "not connected", log_path=self.log_path))
            # Encode everything first: a frame over the limit must not leave some ranks with a command.
            # A rollout's shards can be large, so the encoding runs off the event loop.
            requests = {
                rank: protocol.Request(next(self._request_ids), command) for rank, command in commands.items()
            }

            def encode() -> dict[int, tuple[int, bytes]]:
                return {
                    rank: (
                        request.request_id,
                        protocol.frame(protocol.encode_message(request), self.max_frame_bytes),
                    )
                    for rank, request in requests.items()
                }

            frames = await anyio.to_thread.run_sync(encode)
            call = _Call()
            pendings: dict[int, _Pending] = {}
            for rank, (request_id, data) in frames.items():
                conn = self._connections[rank]
                pending = _Pending(rank, call)
                conn.pending[request_id] = pending
                pendings[rank] = pending
                try:
                    async with conn.send_lock:
                        await conn.stream.send(data)
                except _STREAM_ERRORS as exc:
                    conn.pending.pop(request_id, None)
                    self._fail(
                        RankFailure(
                            [rank],
                            f"rank {rank} could not be sent a command ({exc!r})",
                            log_path=self.log_path,
                        )
                    )
                    pending.resolve(failure=self._failure)
            return await self._gather(next(iter(commands.values())).kind, call, pendings)

    async def _gather(
        self, kind: str, call: _Call, pendings: dict[int, _Pending]
    ) -> dict[int, dict[str, Any]]:
        error_deadline: float | None = None
        while True:
            changed = call.changed
            failures = [p.failure for p in pendings.values() if p.failure is not None]
            if failures:
                raise await self._with_log(failures[0])
            errors = {
                p.rank: p.response for p in pendings.values() if p.response is not None and not p.response.ok
            }
            if all(p.done for p in pendings.values()) or (
                errors and error_deadline is not None and anyio.current_time() >= error_deadline
            ):
                if errors:
                    self._broken = RankCommandError(kind, errors)  # type: ignore[arg-type]
                    raise self._broken
                return {rank: p.response.result for rank, p in pendings.items()}  # type: ignore[union-attr]
            if errors and error_deadline is None:
                # Other ranks may be stuck in a collective the failed rank never entered: wait briefly
                # for their answers (or a disconnect), then report the error rather than hang.
                error_deadline = anyio.current_time() + self.error_window_s
            if error_deadline is None:
                await changed.wait()
            else:
                with anyio.move_on_after(max(0.0, error_deadline - anyio.current_time())):
                    await changed.wait()

    async def _with_log(self, failure: RankFailure) -> RankFailure:
        """The failure with the log's last lines; torchrun gets a moment to write the rank's traceback."""
        if failure.log_tail or not self.launch:
            return failure
        process = self._process
        if process is not None and process.returncode is None:
            with anyio.move_on_after(min(self.grace_s, 3.0)):
                await process.wait()
        return RankFailure(
            failure.ranks, failure.reason, log_path=self.log_path, log_tail=_tail(self.log_path)
        )

    async def _call_all(self, command: protocol.Command) -> dict[int, dict[str, Any]]:
        return await self._call({rank: command for rank in range(self.world_size)})

    # ------------------------------------------------------------------------------------------ commands

    async def init(self, train_config: dict[str, Any]) -> dict[str, Any]:
        """Load the model on every rank and build the optimizer. Returns rank 0's summary."""
        steps_config(train_config)  # reject contradictory batch settings before any rank loads a model
        results = await self._call_all(protocol.InitCommand(dict(train_config)))
        self.train_config = dict(train_config)
        return results[0]

    async def train(self, rollout_id: int, samples: Sequence[Any]) -> dict[str, float]:
        """Train on one rollout's samples (`replay.sample.Sample`s with advantages set).

        The samples are cut into optimizer steps in order (`global_batch_size` samples each, or
        `num_steps_per_rollout` equal steps, else one step); each step is split across ranks balanced
        by token count. Returns the rollout's metrics; `step_metrics` keeps one dict per step.
        """
        if self.train_config is None:
            raise RuntimeError("TrainGroup.train() before init(): call init(train_config) first")
        config = self.train_config

        def prepare() -> list[StepPlan]:
            # Converting and splitting thousands of samples would stall the event loop.
            return plan_steps([sample_to_wire(sample) for sample in samples], config, self.world_size)

        plan = await anyio.to_thread.run_sync(prepare)
        commands: dict[int, protocol.Command] = {
            rank: protocol.TrainCommand(
                rollout_id=int(rollout_id),
                steps=[step.shards[rank] for step in plan],
                step_loss_tokens=[step.loss_tokens for step in plan],
            )
            for rank in range(self.world_size)
        }
        results = await self._call(commands)
        per_step = [
            reduce_step_metrics([results[rank]["steps"][index] for rank in range(self.world_size)])
            for index in range(len(plan))
        ]
        self.step_metrics = per_step
        return reduce_rollout_metrics(per_step)

    async def save(
        self, rollout_id: int, extra: dict[str, Any] | None = None, directory: str | Path | None = None
    ) -> Path:
        """Write a resumable checkpoint to `<save_dir>/rollout_<id>` (atomic; `latest` updated)."""
        target = directory or (self.train_config or {}).get("save_dir")
        if not target:
            raise ValueError(
                "save() needs a directory: pass directory= or set 'save_dir' in the train config"
            )
        command = protocol.SaveCommand(
            rollout_id=int(rollout_id), directory=str(target), extra=dict(extra or {})
        )
        results = await self._call_all(command)
        return Path(results[0]["path"])

    async def load_checkpoint(self, path: str | Path) -> CheckpointInfo:
        """Restore a checkpoint (a save dir → its `latest`, or a `rollout_<id>` dir) on every rank."""
        results = await self._call_all(protocol.LoadCommand(str(path)))
        first = results[0]
        return CheckpointInfo(
            rollout_id=int(first["rollout_id"]), extra=dict(first["extra"]), path=Path(first["path"])
        )

    async def load(self, path: str | Path) -> int:
        """Restore a checkpoint; returns the rollout id it was saved at (resume at that id + 1)."""
        return (await self.load_checkpoint(path)).rollout_id

    async def export_weights(self, directory: str | Path, weight_version: str | int, keep: int = 2) -> Path:
        """Rank 0 writes `<directory>/weights-<version>` (HF safetensors + config/tokenizer); keeps the last `keep`."""
        command = protocol.ExportWeightsCommand(
            directory=str(directory), weight_version=str(weight_version), keep=keep
        )
        results = await self._call_all(command)
        return Path(results[0]["path"])

    async def weight_manifest(self) -> list[tuple[str, str, list[int]]]:
        """(name, dtype, shape) of every tensor a broadcast sends, in broadcast order."""
        results = await self._call_all(protocol.WeightManifestCommand())
        return [(name, dtype, list(shape)) for name, dtype, shape in results[0]["manifest"]]

    async def broadcast_weights(
        self,
        master_address: str,
        master_port: int,
        world_size: int,
        group_name: str = "weight_update_group",
        timeout_s: float = 120.0,
    ) -> list[tuple[str, str, list[int]]]:
        """Rank 0 joins (or reuses) the weight-update group as rank 0 and broadcasts every tensor.

        Returns when rank 0 has sent everything. Meanwhile the caller posts
        `/init_weights_update_group` (first time for this group) and `/update_weights_from_distributed`
        with `weight_manifest()`'s names/dtypes/shapes to the engines.
        """
        command = protocol.BroadcastWeightsCommand(
            master_address=master_address,
            master_port=int(master_port),
            world_size=int(world_size),
            group_name=group_name,
            timeout_s=float(timeout_s),
        )
        results = await self._call_all(command)
        return [(name, dtype, list(shape)) for name, dtype, shape in results[0]["manifest"]]

    async def destroy_weight_group(self, group_name: str = "weight_update_group") -> bool:
        results = await self._call({0: protocol.DestroyWeightGroupCommand(group_name)})
        return bool(results[0]["destroyed"])


# ------------------------------------------------------------------------------------ pure helpers


@dataclass
class StepPlan:
    shards: list[list[dict[str, Any]]]
    loss_tokens: int


def sample_to_wire(sample: Any) -> dict[str, Any]:
    """A `Sample` (or a dict with the same fields) → the map a rank trains on."""
    if isinstance(sample, dict):
        fields = sample
    else:
        if hasattr(sample, "validate"):
            sample.validate()
        fields = {
            "tokens": sample.tokens,
            "response_length": sample.response_length,
            "loss_mask": sample.loss_mask,
            "rollout_log_probs": sample.rollout_log_probs,
            "advantage": sample.advantage,
        }
    return {
        "tokens": [int(token) for token in fields["tokens"]],
        "response_length": int(fields["response_length"]),
        "loss_mask": [int(value) for value in fields["loss_mask"]],
        "rollout_log_probs": [float(value) for value in fields["rollout_log_probs"]],
        "advantage": float(fields.get("advantage", 0.0)),
    }


def steps_config(train_config: dict[str, Any]) -> tuple[int | None, int | None]:
    global_batch_size = train_config.get("global_batch_size")
    num_steps = train_config.get("num_steps_per_rollout")
    if global_batch_size is not None and num_steps is not None:
        raise ValueError(
            "set either global_batch_size or num_steps_per_rollout in the train config, not both"
        )
    for name, value in (("global_batch_size", global_batch_size), ("num_steps_per_rollout", num_steps)):
        if value is not None and (not isinstance(value, int) or value < 1):
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return global_batch_size, num_steps


def plan_steps(
    samples: list[dict[str, Any]], train_config: dict[str, Any], world_size: int
) -> list[StepPlan]:
    """Cut samples into optimizer steps (in order) and each step into per-rank shards by token count."""
    if not samples:
        raise ValueError("train() got no samples")
    global_batch_size, num_steps = steps_config(train_config)
    if num_steps is not None:
        if len(samples) % num_steps:
            raise ValueError(
                f"{len(samples)} samples cannot be cut into num_steps_per_rollout={num_steps} equal steps"
            )
        global_batch_size = len(samples) // num_steps
    if global_batch_size is None:
        global_batch_size = len(samples)
    if len(samples) % global_batch_size:
        raise ValueError(
            f"{len(samples)} samples are not a multiple of global_batch_size={global_batch_size}; "
            "make rollout_batch_size × n_samples_per_prompt divisible by it"
        )
    if global_batch_size < world_size:
        raise ValueError(
            f"global_batch_size={global_batch_size} is smaller than the {world_size} data-parallel ranks: "
            "every rank needs at least one sample per step"
        )
    plan = []
    for start in range(0, len(samples), global_batch_size):
        step = samples[start : start + global_batch_size]
        shards = balance_by_tokens([len(sample["tokens"]) for sample in step], world_size)
        plan.append(
            StepPlan(
                shards=[[step[index] for index in shard] for shard in shards],
                loss_tokens=sum(sum(sample["loss_mask"]) for sample in step),
            )
        )
    return plan


def balance_by_tokens(lengths: Sequence[int], parts: int) -> list[list[int]]:
    """Greedy longest-first partition of indices into `parts` lists with near-equal token sums.

    Every part gets at least one index when there are enough; each part keeps its indices in their
    original order so the split is deterministic.
    """
    loads = [0] * parts
    shards: list[list[int]] = [[] for _ in range(parts)]
    order = sorted(range(len(lengths)), key=lambda index: (-lengths[index], index))
    for position, index in enumerate(order):
        if position < parts:
            target = position
        else:
            target = min(range(parts), key=lambda part: (loads[part], len(shards[part]), part))
        shards[target].append(index)
        loads[target] += lengths[index]
    return [sorted(shard) for shard in shards]


def reduce_step_metrics(rank_steps: Sequence[dict[str, Any]]) -> dict[str, float]:
    """Combine the ranks' raw sums / maxima for one optimizer step into the step's metrics."""
    sums: dict[str, float] = {}
    maxima: dict[str, float] = {}
    for step in rank_steps:
        for key, value in step["sum"].items():
            sums[key] = sums.get(key, 0.0) + float(value)
        for key, value in step["max"].items():
            maxima[key] = max(maxima.get(key, 0.0), float(value))
    values = rank_steps[0]["value"]
    loss_tokens = max(sums.get("loss_tokens", 0.0), 1.0)
    step_time = max(float(step["value"]["step_time_s"]) for step in rank_steps)
    return {
        "loss": sums.get("loss", 0.0),
        "pg_loss": sums.get("pg_loss", 0.0),
        "pg_clipfrac": sums.get("clipped_tokens", 0.0) / loss_tokens,
        "kl": sums.get("kl_sum", 0.0) / loss_tokens,
        "entropy": sums.get("entropy_sum", 0.0) / loss_tokens,
        "grad_norm": float(values["grad_norm"]),
        "lr": float(values["lr"]),
        "num_tokens": sums.get("num_tokens", 0.0),
        "loss_tokens": sums.get("loss_tokens", 0.0),
        "step_time_s": step_time,
        "tokens_per_s": sums.get("num_tokens", 0.0) / step_time if step_time > 0 else 0.0,
        "train_rollout_logprob_abs_diff_mean": sums.get("logprob_abs_diff_sum", 0.0) / loss_tokens,
        "train_rollout_logprob_abs_diff_max": maxima.get("logprob_abs_diff_max", 0.0),
    }


def reduce_rollout_metrics(steps: Sequence[dict[str, float]]) -> dict[str, float]:
    """One rollout's metrics: step means, totals for counts, and the mismatch of the first step only
    (the only one measured before any update, so it isolates train/inference numerics)."""
    count = len(steps)
    result = {
        key: sum(step[key] for step in steps) / count
        for key in ("loss", "pg_loss", "pg_clipfrac", "kl", "entropy", "grad_norm")
    }
    total_tokens = sum(step["num_tokens"] for step in steps)
    total_time = sum(step["step_time_s"] for step in steps)
    result.update(
        {
            "lr": steps[-1]["lr"],
            "num_tokens": total_tokens,
            "loss_tokens": sum(step["loss_tokens"] for step in steps),
            "tokens_per_s": total_tokens / total_time if total_time > 0 else 0.0,
            "train_time_s": total_time,
            "num_steps": float(count),
            "train_rollout_logprob_abs_diff_mean": steps[0]["train_rollout_logprob_abs_diff_mean"],
            "train_rollout_logprob_abs_diff_max": steps[0]["train_rollout_logprob_abs_diff_max"],
        }
    )
    return result


def _tail(path: Path, lines: int = 40, max_bytes: int = 64 * 1024) -> str:
    try:
        with open(path, "rb") as handle:
            handle.seek(0, os.SEEK_END)
            size = handle.tell()
            handle.seek(max(0, size - max_bytes))
            data = handle.read().decode(errors="replace")
    except OSError:
        return ""
    return "\n".join(data.splitlines()[-lines:])
