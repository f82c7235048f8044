"""Launching local engine processes (the CPU engine or SGLang) and ending them.

Owns: one `EngineProcess` per launched engine: its command line, port, log file and OS process group.

Invariants:
  * Every engine runs in its own session / process group (`start_new_session=True`), so one `killpg`
    reaches the server and every helper it forked (SGLang's scheduler and detokenizer processes).
  * A launch either returns a healthy engine (it answered `/health_generate`) or raises
    `EngineLaunchError` with the tail of the engine's log, and leaves no process behind. A process that
    exits while starting is reported at once, not after the start deadline.
  * `stop()` always ends the whole group: SIGTERM, SIGKILL after a grace period, then reap. It runs shielded,
    so cancellation of the caller cannot leave an orphan.

Processes are started, watched and ended with `coordinator.lifecycle.processes` (its docstring says why they are
`subprocess.Popen` children polled with `waitid(WNOWAIT)`).
"""

from __future__ import annotations

import logging
import os
import re
import shlex
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING

import anyio

from coordinator.config.secrets import mask_argv
from coordinator.engines.client import EngineClient
from coordinator.engines.errors import EngineError
from coordinator.engines.policy import NO_RETRY
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

if TYPE_CHECKING:
    from coordinator.config import ClusterConfig, SglangConfig

log = logging.getLogger("rayless")

#: Ports handed out by this process recently; a second launch in the same moment must not get the same one.
_RESERVED: dict[int, float] = {}
_RESERVE_SECONDS = 60.0

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


def port_is_free(host: str, port: int) -> bool:
    """Whether a server could bind `host:port` now (as servers bind: with SO_REUSEADDR)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def claim_port(host: str, planned: int | None, *, what: str) -> int:
    """The planned port when it is free, else another free one — and a warning saying so."""
    if planned is None:
        return free_port(host)
    if port_is_free(host, planned):
        return planned
    port = free_port(host)
    log.warning("%s: planned port %d on %s is in use; using port %d instead", what, planned, host, port)
    return port


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago and not handed out by this process in the last minute.

    Binding port 0 and releasing it is racy against other processes; launches retry on address-in-use.
    """
    now = time.monotonic()
    for port, t in list(_RESERVED.items()):
        if now - t > _RESERVE_SECONDS:
            del _RESERVED[port]
    for _ in range(100):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        if port not in _RESERVED:
            _RESERVED[port] = now
            return port
    raise RuntimeError("could not find a free port")


#: "rayless": our engine (`workers.engine`, CPU or CUDA); "sglang": `sglang.launch_server`.
ENGINE_KINDS = ("rayless", "sglang")


@dataclass(frozen=True)
class EngineLaunchSpec:
    """How to start one local engine (the placement plan builds one per engine; tests build their own).

    kind: "rayless" runs our engine (`python -m workers.engine`; its device is in `extra_args`), "sglang" runs
    `python -m sglang.launch_server`. extra_args: appended verbatim (the `--sglang-*` passthrough for SGLang,
    engine flags for ours). env: set on top of the coordinator's environment (CUDA_VISIBLE_DEVICES).
    port: the planned port, tried first (another is taken, and said so, when it is in use).
    tp_size: the engine's tensor-parallel ranks (SGLang's `--tp-size`): each joins a weight-update group.
    """

    kind: str
    model_path: str
    host: str = "127.0.0.1"
    api_key: str | None = None
    extra_args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    port: int | None = None
    tp_size: int = 1
    start_timeout: float = 300.0
    stop_grace: float = 10.0
    python: str = field(default=sys.executable)

    def __post_init__(self) -> None:
        if self.tp_size < 1:
            raise ValueError(f"an engine's tp_size must be >= 1, got {self.tp_size}")
        if self.kind not in ENGINE_KINDS:
            raise ValueError(f"engine kind must be one of {', '.join(ENGINE_KINDS)}, got {self.kind!r}")

    def command(self, port: int) -> list[str]:
        module = "workers.engine" if self.kind == "rayless" else "sglang.launch_server"
        cmd = [
            self.python,
            "-m",
            module,
            "--model-path",
            str(self.model_path),
            "--host",
            self.host,
            "--port",
            str(port),
        ]
        if self.api_key:
            cmd += ["--api-key", self.api_key]
        return cmd + list(self.extra_args)


def engine_launch_spec(*, model_path: str, sglang: SglangConfig, cluster: ClusterConfig, seed: int,
                       enable_metrics: bool, backend: str = "rayless", device: str = "cpu",
                       gpus: Sequence[int] = (), visible_devices: str | None = None,
                       port: int | None = None, release_memory: bool = False,
                       spill_dir: str | None = None) -> EngineLaunchSpec:
    """How the run launches one engine (rollout or eval), from the sglang and cluster slices and its placement.

    `backend`/`device`: the plan's choice (`coordinator.plan.backend`). `gpus`: the engine's GPU positions
    among those the coordinator sees. SGLang gets `--tp-size`, `--base-gpu-id` (its first GPU; it inherits the
    coordinator's CUDA_VISIBLE_DEVICES) and the `--sglang-*` passthrough; our engine gets our flags (seed,
    request slots) and `--device`: on CUDA it sees only its GPU (`visible_devices` as CUDA_VISIBLE_DEVICES)
    and runs on `--base-gpu-id 0`. `enable_metrics`: the health monitor tells slow from hung by /metrics.
    `release_memory`: the run releases the engine's memory each step (`--offload-rollout`), which SGLang allows
    only with `--enable-memory-saver`; `spill_dir`: where our CPU engine writes released weights.
    """
    extra: list[str] = ["--weight-version", "0"]
    env: tuple[tuple[str, str], ...] = ()
    if sglang.sglang_context_length:
        extra += ["--context-length", str(sglang.sglang_context_length)]
    if enable_metrics:
        extra.append("--enable-metrics")
    tp_size = 1
    if backend == "sglang":
        tp_size = cluster.rollout_num_gpus_per_engine
        extra += ["--tp-size", str(tp_size)]
        if gpus:
            extra += ["--base-gpu-id", str(gpus[0])]
        extra += sglang.sglang_passthrough
        if release_memory and "--enable-memory-saver" not in sglang.sglang_passthrough:
            extra.append("--enable-memory-saver")
    else:
        extra += ["--random-seed", str(seed), "--max-running-requests", str(sglang.sglang_server_concurrency)]
        if device == "cuda":
            if len(gpus) != 1 or not visible_devices:
                raise ValueError(f"our engine on CUDA runs on exactly one GPU, got positions {list(gpus)}")
            extra += ["--device", "cuda", "--base-gpu-id", "0"]
            env = (("CUDA_VISIBLE_DEVICES", visible_devices),)
        else:
            extra += ["--device", "cpu"]
        if spill_dir is not None:
            extra += ["--weight-spill-dir", spill_dir]
    return EngineLaunchSpec(kind=backend, model_path=model_path, api_key=sglang.sglang_api_key,
                            extra_args=tuple(extra), env=env, port=port, tp_size=tp_size)


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
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "ab")  # noqa: ASYNC230 - local append-only log, closed in stop()
        cmd = self.spec.command(self.port or 0)
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


def engine_log_path(run_dir: Path, name: str) -> Path:
    return Path(run_dir) / "logs" / f"engine-{name}.log"


async def launch_engine(
    spec: EngineLaunchSpec, *, name: str, run_dir: Path, client: EngineClient, port: int | None = None
) -> EngineProcess:
    """Start one engine and return it healthy (caller owns `stop()`), or raise EngineLaunchError."""
    ep = EngineProcess(spec, name=name, log_path=engine_log_path(run_dir, name), client=client)
    await ep.start(port=port)
    return ep


def parse_passthrough(args: Sequence[str] | str | None) -> tuple[str, ...]:
    """`--sglang-*` passthrough arrives as a list or one shell-quoted string."""
    if args is None:
        return ()
    if isinstance(args, str):
        return tuple(shlex.split(args))
    return tuple(args)
