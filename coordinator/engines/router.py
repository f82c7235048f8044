"""`--use-sglang-router`: the sglang-router process in front of one engine group (or, with
`--sglang-router-ip/-port`, a router already running that our engines join).

Owns: the router child process (own process group, log file `<run_dir>/logs/router-<name>.log`) and the
registration of workers with it.

Invariants:
  * Both `--port` and `--prometheus-port` are always passed (their defaults, 30000 and 29000, collide with
    other routers and engines).
  * The router speaks one of two worker APIs, found by probing once it is up: 0.3.x `POST/GET/DELETE
    /workers` (asynchronous: add and remove return 202, so we poll until the listing shows the change) or
    ≤ 0.2 `/add_worker`, `/remove_worker`, `/list_workers`. Callers see only add/remove/list of URLs.
  * The router process is stopped (SIGTERM to its group, SIGKILL after a grace period, reaped) on every exit
    path of `run()`.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import IO

import anyio

from coordinator.engines.client import EngineClient
from coordinator.engines.errors import EngineError, EngineHTTPError
from coordinator.engines.policy import NO_RETRY
from coordinator.engines.spec import claim_port, router_command, router_log_path
from coordinator.lifecycle.processes import (
    exit_status,
    read_tail,
    spawn_group_leader,
    terminate_process_group,
    with_log_tail,
)
from coordinator.observe.startup import NO_OBSERVER, PhaseObserver
from workers.boundary.json_input import JsonObject
from workers.errors import RaylessError


class RouterError(RaylessError, RuntimeError):
    """The router failed to start, or did not take a worker change."""


class RouterHandle:
    """A running sglang-router. Send generate traffic to `url`; change workers with add/remove.

    `port` / `prometheus_port`: the planned ports, taken unless in use (then others, and a warning); free
    ports when None. `observer`: told the router's start-up phases.
    """

    def __init__(
        self,
        *,
        client: EngineClient,
        run_dir: Path,
        name: str = "rollout",
        policy: str = "cache_aware",
        host: str = "127.0.0.1",
        extra_args: Sequence[str] = (),
        start_timeout: float = 60.0,
        change_timeout: float = 60.0,
        stop_grace: float = 5.0,
        python: str = sys.executable,
        address: str | None = None,
        port: int | None = None,
        prometheus_port: int | None = None,
        observer: PhaseObserver | None = None,
    ) -> None:
        """`address` (HOST:PORT): attach to a router already running there (`--sglang-router-ip/-port`, as
        slime): nothing is launched or stopped; workers are registered with it."""
        self.client = client
        self.address = address
        self.planned_ports = (port, prometheus_port)
        self.observer = observer or NO_OBSERVER
        self.run_dir = Path(run_dir)
        self.name = name
        self.policy = policy
        self.host = host
        self.extra_args = tuple(extra_args)
        self.start_timeout = start_timeout
        self.change_timeout = change_timeout
        self.stop_grace = stop_grace
        self.python = python
        self.port: int | None = None
        self.prometheus_port: int | None = None
        self.api: str | None = None  # "workers" (0.3.x) or "legacy" (≤ 0.2)
        self.log_path = router_log_path(self.run_dir, name)
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    @property
    def url(self) -> str:
        if self.port is None:
            raise RuntimeError("router not started")
        return f"http://{self.host}:{self.port}"

    # -- lifetime ------------------------------------------------------------------------------------

    async def run(
        self,
        worker_urls: Sequence[str] = (),
        *,
        task_status: anyio.abc.TaskStatus[RouterHandle] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        """Start the router, register `worker_urls`, signal started, serve until cancelled, then stop it."""
        try:
            await self._start()
            for url in worker_urls:
                await self.add_worker(url)
            task_status.started(self)
            await anyio.sleep_forever()
        finally:
            with anyio.CancelScope(shield=True):
                if self.address is not None:
                    await self._leave(worker_urls)
                await self._stop()

    async def _leave(self, worker_urls: Sequence[str]) -> None:
        """An attached router outlives the run: take our engines off it (best effort, bounded)."""
        with anyio.move_on_after(self.change_timeout):
            for url in worker_urls:
                try:
                    await self.remove_worker(url)
                except (EngineError, RouterError):
                    continue

    async def _attach(self, address: str) -> None:
        host, _, port = address.rpartition(":")
        self.host, self.port = host, int(port)
        try:
            await self.client.request(self.url, "GET", "/health", timeout=self.start_timeout, retry=NO_RETRY)
        except EngineError as exc:
            raise RouterError(f"no sglang-router answers at {address} (--sglang-router-ip/--sglang-router-port): "
                              f"{exc}") from exc
        self.api = await self._detect_api()

    async def _start(self) -> None:
        if self.address is not None:
            await self._attach(self.address)
            return
        what = f"router-{self.name}"
        self.port = claim_port(self.host, self.planned_ports[0], what=what)
        self.prometheus_port = claim_port(self.host, self.planned_ports[1], what=f"{what} (prometheus)")
        cmd = router_command(python=self.python, host=self.host, port=self.port,
                             prometheus_port=self.prometheus_port, policy=self.policy, extra_args=self.extra_args)
        self.observer.phase(what, "starting", f"port {self.port}")
        # Workers are registered through the API once the router is up (one path for startup and changes).
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "ab")  # noqa: ASYNC230 - local append-only log, closed in _stop()
        self._log.write(f"\n=== rayless: starting router: {' '.join(cmd)}\n".encode())
        self._log.flush()
        self.proc = spawn_group_leader(cmd, log=self._log)
        try:
            with anyio.fail_after(self.start_timeout):
                while True:
                    if (code := exit_status(self.proc)) is not None:
                        raise RouterError(self._with_tail(f"router exited with status {code} while starting"))
                    try:
                        await self.client.request(self.url, "GET", "/health", timeout=2.0, retry=NO_RETRY)
                        break
                    except EngineError:
                        await anyio.sleep(0.1)
            self.api = await self._detect_api()
        except TimeoutError:
            self.observer.phase(what, "failed", f"not answering /health within {self.start_timeout:.0f}s")
            raise RouterError(
                self._with_tail(f"router not answering /health within {self.start_timeout:.0f}s")
            ) from None
        except RouterError as error:
            self.observer.phase(what, "failed", str(error).splitlines()[0])
            raise
        self.observer.phase(what, "healthy")

    async def _detect_api(self) -> str:
        try:
            await self.client.request(self.url, "GET", "/workers", timeout=5.0, retry=NO_RETRY)
            return "workers"
        except EngineHTTPError as exc:
            if exc.status not in (404, 405):
                raise
        await self.client.request(self.url, "GET", "/list_workers", timeout=5.0, retry=NO_RETRY)
        return "legacy"

    def _with_tail(self, message: str) -> str:
        if self._log is not None:
            self._log.flush()
        return with_log_tail(message, self.log_path, read_tail(self.log_path))

    async def _stop(self) -> None:
        proc = self.proc
        if proc is None or proc.returncode is not None:
            return
        await terminate_process_group(proc, self.stop_grace)
        if self._log is not None:
            self._log.write(f"=== rayless: router ended with status {proc.returncode}\n".encode())
            self._log.close()
            self._log = None

    # -- workers -------------------------------------------------------------------------------------

    async def list_workers(self) -> list[str]:
        """URLs of the registered workers (healthy or not: a killed worker stays listed)."""
        return [w["url"] for w in await self._workers()]

    async def _workers(self) -> list[JsonObject]:
        if self.api == "workers":
            body = await self.client.request_json(self.url, "GET", "/workers", timeout=10.0)  # decoded bounded
            workers = body.get("workers", []) if isinstance(body, dict) else []
            return [w for w in workers if isinstance(w, dict) and isinstance(w.get("url"), str)]
        body = await self.client.request_json(self.url, "GET", "/list_workers", timeout=10.0)
        urls = body.get("urls", []) if isinstance(body, dict) else []
        return [{"url": u} for u in urls if isinstance(u, str)]

    async def add_worker(self, url: str) -> None:
        """Register an engine and wait until the router lists it."""
        url = url.rstrip("/")
        if url in await self.list_workers():
            return
        try:
            if self.api == "workers":
                await self.client.request(self.url, "POST", "/workers", json_body={"url": url}, timeout=30.0)
            else:
                await self.client.request(self.url, "POST", "/add_worker", params={"url": url}, timeout=120.0)
        except EngineHTTPError as exc:
            raise RouterError(f"router refused worker {url}: {exc.server_message}") from exc
        await self._wait_listed(url, present=True)

    async def remove_worker(self, url: str) -> None:
        """Deregister an engine and wait until the router no longer lists it."""
        url = url.rstrip("/")
        workers = [w for w in await self._workers() if w["url"].rstrip("/") == url]
        if not workers:
            return
        try:
            if self.api == "workers":
                for w in workers:
                    await self.client.request(self.url, "DELETE", f"/workers/{w['id']}", timeout=30.0)
            else:
                await self.client.request(
                    self.url, "POST", "/remove_worker", params={"url": url}, timeout=30.0
                )
        except EngineHTTPError as exc:
            raise RouterError(f"router refused to remove worker {url}: {exc.server_message}") from exc
        await self._wait_listed(url, present=False)

    async def _wait_listed(self, url: str, *, present: bool) -> None:
        try:
            with anyio.fail_after(self.change_timeout):
                while (url in [u.rstrip("/") for u in await self.list_workers()]) != present:
                    if self.proc is not None and (code := exit_status(self.proc)) is not None:
                        raise RouterError(self._with_tail(f"router exited with status {code}"))
                    await anyio.sleep(0.1)
        except TimeoutError:
            what = "register" if present else "remove"
            raise RouterError(
                self._with_tail(f"router did not {what} worker {url} within {self.change_timeout:.0f}s")
            ) from None
