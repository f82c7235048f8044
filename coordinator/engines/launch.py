"""Launching local engine processes (the CPU engine or SGLang) and ending them.

Owns: one `EngineProcess` per launched engine: its command line, port, log file and OS process group.

Invariants:
  * Every engine runs in its own session / process group (`start_new_session=True`), so one `killpg`
    reaches the server and every helper it forked (SGLang's scheduler and detokenizer processes).
  * A launch either returns a healthy engine (it answered `/health_generate`) or raises
    `EngineLaunchError` with the tail of the engine's log, and leaves no process behind. A process that
    exits while starting is reported at once, not after the start deadline.
  * No secret is on an engine's command line: the spec's secrets are in a 0600 file (`secrets_file`) that
    exists only while the engine starts.
  * `stop()` always ends the whole group: SIGTERM, SIGKILL after a grace period, then reap. It runs shielded,
    so cancellation of the caller cannot leave an orphan.

Processes are started, watched and ended with `coordinator.lifecycle.processes` (its docstring says why they are
`subprocess.Popen` children polled with `waitid(WNOWAIT)`).
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
from pathlib import Path
from typing import IO

import anyio

from coordinator.config.secrets import mask_argv
from coordinator.engines.client import EngineClient
from coordinator.engines.errors import EngineError
from coordinator.engines.policy import NO_RETRY
from coordinator.engines.secrets_file import secrets_file
from coordinator.engines.spec import EngineLaunchSpec, claim_port, engine_log_path, free_port
from coordinator.lifecycle.processes import (
    exit_status,
    read_tail,
    spawn_group_leader,
    terminate_process_group,
    wait_exited,
    with_log_tail,
)
from coordinator.observe.startup import NO_OBSERVER, PhaseObserver
from workers.errors import RaylessError

log = logging.getLogger("rayless")

#: A log line's leading timestamp (ours: `2025-01-01 12:00:00,123`; SGLang's: `[2025-01-01 12:00:00]`).
_TIMESTAMP = re.compile(r"^\[?\d{4}-\d\d-\d\d[ T][\d:.,]+\]?\s*")

_ADDRESS_IN_USE = ("address already in use", "errno 98", "eaddrinuse", "address in use")


class EngineLaunchError(RaylessError, RuntimeError):
    """An engine failed to start: it exited, or did not become healthy before the deadline."""

    def __init__(
        self, message: str, *, name: str, log_path: Path | None, log_tail: str, returncode: int | None
    ) -> None:
        super().__init__(with_log_tail(f"engine {name}: {message}", log_path, log_tail))
        self.name = name
        self.log_path = log_path
        self.log_tail = log_tail
        self.returncode = returncode


class EngineProcess:
    """One launched engine. `start()` → healthy or EngineLaunchError; `stop()` ends its process group.

    `observer` is told its start-up phases: starting (spawned), loading (it has written to its log but does
    not serve yet; the detail is its latest log line), healthy (/health_generate answered), failed.
    """

    def __init__(self, spec: EngineLaunchSpec, *, name: str, log_path: Path, client: EngineClient,
                 observer: PhaseObserver = NO_OBSERVER) -> None:
        self.spec = spec
        self.name = name
        self.log_path = log_path
        self.client = client
        self.observer = observer
        self.port: int | None = None
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None
        self._log_start = 0  # the log's size once this incarnation's header is written

    @property
    def url(self) -> str:
        if self.port is None:
            raise RuntimeError(f"engine {self.name} has no port yet")
        return f"http://{self.spec.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def exit_code(self) -> int | None:
        """The exit status if the process has exited (without reaping it), else None."""
        return None if self.proc is None else exit_status(self.proc)

    def running(self) -> bool:
        return self.proc is not None and self.exit_code() is None

    async def start(self, *, port: int | None = None, attempts: int = 3) -> str:
        """Spawn the engine and wait until `/health_generate` answers; return its base URL.

        `port`: try this one first (a relaunch keeps its URL when it can), else the spec's planned port; a
        fresh free port is taken, with a warning, when that one is in use or the engine reports the address
        in use.
        """
        if self.running():
            raise RuntimeError(f"engine {self.name} is already running (pid {self.pid})")
        planned = port if port is not None else self.spec.port
        self.port = claim_port(self.spec.host, planned, what=f"engine {self.name}")
        for attempt in range(1, attempts + 1):
            try:
                await self._start_once()
                return self.url
            except EngineLaunchError as exc:
                in_use = any(s in exc.log_tail.lower() for s in _ADDRESS_IN_USE)
                if not in_use or attempt == attempts:
                    self.observer.phase(self.name, "failed", str(exc).splitlines()[0])
                    raise
                taken, self.port = self.port, free_port(self.spec.host)
                log.warning("engine %s: port %s was taken while it started; retrying on port %d", self.name,
                            taken, self.port)
        raise AssertionError("unreachable")

    async def _start_once(self) -> None:
        # the engine reads its secrets at start-up; the file is gone once it serves (or failed to start)
        with secrets_file(self.spec.secrets()) as secrets:
            await self._spawn_and_wait(secrets)

    async def _spawn_and_wait(self, secrets: str | None) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "ab")  # noqa: ASYNC230 - local append-only log, closed in stop()
        cmd = self.spec.command(self.port or 0, secrets_file=secrets)
        shown = " ".join(mask_argv(cmd))  # the API key (and any other secret flag) never reaches the log
        self._log.write(f"\n=== rayless: starting engine {self.name}: {shown}\n".encode())
        self._log.flush()
        self._log_start = self._log.tell()
        self.proc = spawn_group_leader(cmd, log=self._log, env={**os.environ, **dict(self.spec.env)})
        gpus = dict(self.spec.env).get("CUDA_VISIBLE_DEVICES")
        self.observer.phase(self.name, "starting",
                            f"pid {self.proc.pid}, port {self.port}" + (f", GPU {gpus}" if gpus else ""))
        ok = False
        try:
            with anyio.fail_after(self.spec.start_timeout):
                await self._wait_healthy()
            ok = True
        except TimeoutError:
            raise self._launch_error(
                f"not healthy within {self.spec.start_timeout:.0f}s (/health_generate)"
            ) from None
        finally:
            if not ok:
                await self.stop()

    async def _wait_healthy(self) -> None:
        """Probe /health_generate while a sibling task watches the process; whichever ends first wins."""
        engine = self.client.engine(self.url)
        exited: int | None = None
        async with anyio.create_task_group() as tg:

            async def watch() -> None:
                nonlocal exited
                assert self.proc is not None
                exited = await wait_exited(self.proc)
                tg.cancel_scope.cancel()

            async def probe() -> None:
                while True:
                    try:
                        await engine.health_generate(timeout=30.0, retry=NO_RETRY)
                        break
                    except EngineError:
                        await anyio.sleep(0.25)
                tg.cancel_scope.cancel()

            tg.start_soon(watch)
            tg.start_soon(probe)
            tg.start_soon(self._report_loading)
        if exited is not None:  # raised out here, not from the task, so callers get it unwrapped
            raise self._launch_error(f"exited with status {exited} while starting")
        self._note_loading()  # output written between two looks is still a loading phase that happened
        self.observer.phase(self.name, "healthy")

    async def _report_loading(self) -> None:
        """While the engine starts: once it writes to its log it is loading; its latest line is the detail."""
        while True:
            self._note_loading()
            await anyio.sleep(0.5)

    def _note_loading(self) -> None:
        try:
            grown = self.log_path.stat().st_size > self._log_start
        except OSError:
            return
        if grown:
            line = _TIMESTAMP.sub("", read_tail(self.log_path, lines=1, max_bytes=4096))
            self.observer.phase(self.name, "loading", line)

    def _launch_error(self, message: str) -> EngineLaunchError:
        if self._log is not None:
            self._log.flush()
        return EngineLaunchError(
            message,
            name=self.name,
            log_path=self.log_path,
            log_tail=read_tail(self.log_path),
            returncode=self.exit_code(),
        )

    async def stop(self) -> int | None:
        """End the engine's process group (SIGTERM, SIGKILL after the grace period) and reap it. Shielded.

        Returns the exit status, or None if it was never started.
        """
        proc = self.proc
        if proc is None:
            return None
        if proc.returncode is not None:  # already reaped by an earlier stop(): its pgid may be reused now
            self._close_log()
            return proc.returncode
        code = await terminate_process_group(proc, self.spec.stop_grace)
        self._close_log(f"=== rayless: engine {self.name} ended with status {code}\n")
        return code

    def _close_log(self, last_line: str = "") -> None:
        if self._log is not None:
            self._log.write(last_line.encode())
            self._log.close()
            self._log = None


async def launch_engine(
    spec: EngineLaunchSpec, *, name: str, run_dir: Path, client: EngineClient, port: int | None = None
) -> EngineProcess:
    """Start one engine and return it healthy (caller owns `stop()`), or raise EngineLaunchError."""
    ep = EngineProcess(spec, name=name, log_path=engine_log_path(run_dir, name), client=client)
    await ep.start(port=port)
    return ep
