"""The engine fleet: the state of every engine in one group (rollout or eval).

Owns the `EngineHandle`s of one group, each launched engine's spec (one for the group, or one per engine as the
placement plan gives them), the process of each launched engine (one `EngineProcess` per incarnation) and the
change event. Remote engines (another node's) are brought up and relaunched through `RemoteEngines`.

Invariants:
  * This object alone changes an engine's state (STARTING / ALIVE / DEAD) and its process; others ask through
    `mark_dead` / `relaunch`. Every state change sets the change event.
  * An engine's launch spec is never changed: a relaunch with other weights gets a spec for that incarnation only.
  * Launched engines are stopped when `run()` ends, however it ends; external engines are never launched or killed.
  * At most one relaunch of a handle runs at a time; a second caller returns False when the engine came back.
  * An engine is marked ALIVE right after `relaunch`'s `admit` callback returns, with no await in between.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar

import anyio

from coordinator.engines.client import EngineClient
from coordinator.engines.errors import EngineError, EngineUnreachable
from coordinator.engines.launch import EngineLaunchError, EngineProcess
from coordinator.engines.policy import NO_RETRY
from coordinator.engines.spec import EngineLaunchSpec, engine_log_path
from coordinator.lifecycle.processes import leaf_exceptions
from coordinator.observe.startup import NO_OBSERVER, PhaseObserver

T = TypeVar("T")

#: Called with an engine that answers but is not yet ALIVE; raising keeps it out of dispatch (DEAD).
Admit = Callable[["EngineHandle"], Awaitable[None]]


class RemoteEngines(Protocol):
    """Engines other nodes launch and report (multi-node; `coordinator.nodes.registry.NodeRegistry`)."""

    async def wait_up(self, name: str, *, newer_than: int, timeout: float) -> tuple[str, int]:
        """(URL, report serial) of the engine's latest report with a serial above `newer_than`; EngineError
        when its node reports it failed, or nothing comes within `timeout`."""
        ...

    async def request_relaunch(self, name: str, *, serial: int, model_path: str | None,
                               weight_version: str | None) -> None:
        """Ask the engine's node to start it again (nothing to ask when a newer report is in, or the node is
        gone: a node that comes back launches its engines and reports them)."""
        ...


class EngineState(enum.Enum):
    STARTING = "starting"
    ALIVE = "alive"
    DEAD = "dead"


@dataclass(eq=False)
class EngineHandle:
    """One engine of the group. Read its fields; change its state only through the fleet."""

    name: str
    url: str
    launched: bool
    state: EngineState = EngineState.STARTING
    in_flight: int = 0
    dead_reason: str | None = None
    #: bumped on every (re)start, so a caller can tell a relaunched engine from the one it last used
    incarnation: int = 0
    #: tensor-parallel ranks (GPUs) of the engine: each is one rank of a weight-update group; None for an
    #: external engine (the weight sync asks its /server_info)
    tp_size: int | None = None
    #: the node that launched it, for a remote engine (multi-node); None for this node's and external ones
    node: int | None = None
    #: the serial of the node's report this handle's URL comes from (remote engines)
    remote_serial: int = 0
    process: EngineProcess | None = field(default=None, repr=False)
    _lock: anyio.Lock = field(default_factory=anyio.Lock, repr=False)

    @property
    def alive(self) -> bool:
        return self.state is EngineState.ALIVE


class EngineFleet:
    """Launches (or attaches) one group of engines and keeps their states.

    Args:
        client: the shared engine client (its pool serves every engine of every group).
        group: "rollout", "eval", ...; engine names are `<group>-<i>`.
        launch: how to start local engines: one spec for all of them, or one per engine (the plan's slots,
            each with its GPUs and planned port); None when only external engines are used.
        num_engines: how many local engines to launch (default with a list of specs: one per spec).
        external_urls: addresses of engines started elsewhere; probed, never launched or killed.
        run_dir: logs go to `<run_dir>/logs/engine-<name>.log`.
        probe_timeout: read timeout of one `/health_generate` probe.
        attach_timeout: how long to wait for an external engine to answer (and for a remote one's node to
            report it).
        observer: told each launched engine's start-up phases (the run's start-up board).
        remote: where remote engines' URLs come from; remote_engines: (name, node) of each, named as the
            placement plan names them on their node.
    """

    def __init__(
        self,
        *,
        client: EngineClient,
        group: str = "rollout",
        launch: EngineLaunchSpec | Sequence[EngineLaunchSpec] | None = None,
        num_engines: int | None = None,
        external_urls: Sequence[str] = (),
        run_dir: Path,
        probe_timeout: float = 30.0,
        attach_timeout: float = 300.0,
        observer: PhaseObserver = NO_OBSERVER,
        remote: RemoteEngines | None = None,
        remote_engines: Sequence[tuple[str, int]] = (),
    ) -> None:
        specs = _per_engine(launch, num_engines, group)
        if remote_engines and remote is None:
            raise ValueError(f"{group}: remote engines need `remote` (the node registry) to learn their URLs")
        if not specs and not external_urls and not remote_engines:
            raise ValueError(f"{group}: no engines: give num_engines > 0 or external_urls")
        self.client = client
        self.group = group
        self.launch = launch
        self.observer = observer
        self.run_dir = Path(run_dir)
        self.probe_timeout = probe_timeout
        self.attach_timeout = attach_timeout
        self.remote = remote
        self._changed = anyio.Event()
        self._running = False
        self.engines: list[EngineHandle] = []
        #: each launched engine's own spec, by name
        self.specs: dict[str, EngineLaunchSpec] = {}
        for i, spec in enumerate(specs):
            name = f"{group}-{i}"
            self.specs[name] = spec
            self.engines.append(EngineHandle(name=name, url="", launched=True, process=self._process(name, spec),
                                             tp_size=spec.tp_size))
        for j, url in enumerate(external_urls):
            url = url if url.startswith(("http://", "https://")) else f"http://{url}"
            self.engines.append(EngineHandle(name=f"{group}-ext-{j}", url=url.rstrip("/"), launched=False))
        for name, node in remote_engines:
            self.engines.append(EngineHandle(name=name, url="", launched=False, node=node))

    # -- lifetime ------------------------------------------------------------------------------------

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[EngineFleet] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Bring every engine up concurrently, signal started, then serve until cancelled.

        A launch failure raises EngineLaunchError out of here (the other engines are stopped).
        """
        if self._running:
            raise RuntimeError(f"fleet {self.group} is already running")
        self._running = True
        try:
            try:
                async with anyio.create_task_group() as tg:
                    for h in self.engines:
                        tg.start_soon(self._bring_up, h, self.attach_timeout)
            except Exception as exc:
                # One engine failing cancels the others' launches: raise the engine's own error rather than
                # an exception group (the group, naming any other failed engine, stays as its cause).
                leaves = leaf_exceptions(exc)
                if all(isinstance(e, EngineLaunchError | EngineError) for e in leaves):
                    raise leaves[0] from (exc if len(leaves) > 1 else None)
                raise
            task_status.started(self)
            await anyio.sleep_forever()
        finally:
            self._running = False  # first: a relaunch finishing from now on stops what it started
            with anyio.CancelScope(shield=True):
                await self._stop_all()

    async def _stop_all(self) -> None:
        async with anyio.create_task_group() as tg:
            for h in self.engines:
                if h.process is not None:
                    tg.start_soon(h.process.stop)
        for h in self.engines:
            if h.launched and h.state is not EngineState.DEAD:
                self._set(h, EngineState.DEAD, "fleet stopped")

    def _process(self, name: str, spec: EngineLaunchSpec) -> EngineProcess:
        return EngineProcess(spec, name=name, log_path=engine_log_path(self.run_dir, name), client=self.client,
                             observer=self.observer)

    def _spec_for(self, name: str, model_path: str | None, weight_version: str | None) -> EngineLaunchSpec:
        return spec_for_incarnation(self.specs[name], model_path, weight_version)

    async def _bring_up(self, h: EngineHandle, attach_timeout: float, *, port: int | None = None,
                        admit: Admit | None = None) -> None:
        if h.launched:
            self._set(h, EngineState.STARTING, None)
            assert h.process is not None
            h.url = await h.process.start(port=port)
        elif h.node is not None:
            # A remote engine: its node reports where it answers; it keeps its state until then, as below.
            assert self.remote is not None
            h.url, h.remote_serial = await self.remote.wait_up(h.name, newer_than=h.remote_serial,
                                                                timeout=attach_timeout)
            await self._wait_answers(h, attach_timeout)
            self._set(h, EngineState.STARTING, None)
        else:
            # An external engine keeps its state (DEAD on a relaunch) until it answers again.
            await self._wait_answers(h, attach_timeout)
            self._set(h, EngineState.STARTING, None)
        if admit is not None:
            await admit(h)
        # No await from here to ALIVE: what admit checked still holds when the engine enters dispatch.
        h.incarnation += 1
        self._set(h, EngineState.ALIVE, None)

    async def _wait_answers(self, h: EngineHandle, timeout: float) -> None:
        engine = self.client.engine(h.url)
        last: EngineError | None = None
        try:
            with anyio.fail_after(timeout):
                while True:
                    try:
                        await engine.health_generate(timeout=self.probe_timeout, retry=NO_RETRY)
                        return
                    except EngineError as exc:
                        last = exc
                        await anyio.sleep(0.5)
        except TimeoutError:
            raise EngineError(
                f"external engine {h.name} did not answer /health_generate within {timeout:.0f}s: {last}",
                h.url,
            ) from None

    # -- state ---------------------------------------------------------------------------------------

    def _set(self, h: EngineHandle, state: EngineState, reason: str | None) -> None:
        h.state = state
        h.dead_reason = reason if state is EngineState.DEAD else None
        self._changed.set()
        self._changed = anyio.Event()

    def alive(self) -> list[EngineHandle]:
        return [h for h in self.engines if h.state is EngineState.ALIVE]

    def find(self, name: str) -> EngineHandle | None:
        return next((h for h in self.engines if h.name == name), None)

    def mark_dead(self, handle: EngineHandle, reason: str) -> None:
        """Take an engine out of dispatch. Idempotent."""
        if handle.state is not EngineState.DEAD:
            self._set(handle, EngineState.DEAD, reason)

    async def wait_changed(self) -> None:
        """Return at the next state change of any engine."""
        await self._changed.wait()

    async def wait_any_alive(self, timeout: float | None = None) -> list[EngineHandle]:
        """The alive engines, waiting up to `timeout` seconds for one; TimeoutError if none came."""
        with anyio.fail_after(timeout):
            while not (alive := self.alive()):
                await self.wait_changed()
        return alive

    @contextmanager
    def use(self, handle: EngineHandle) -> Iterator[EngineHandle]:
        """Count a request against `handle.in_flight` (least-in-flight dispatch reads it)."""
        handle.in_flight += 1
        try:
            yield handle
        finally:
            handle.in_flight -= 1

    async def check(self, handle: EngineHandle) -> bool:
        """Is the engine serving? A launched engine whose process has exited is marked dead here (with its
        exit status); a failed probe only returns False (the health monitor counts consecutive failures)."""
        if handle.state is EngineState.STARTING or not handle.url:
            return False
        if self._process_exited(handle):
            return False
        try:
            await self.client.engine(handle.url).health_generate(timeout=self.probe_timeout, retry=NO_RETRY)
        except EngineUnreachable:
            # The socket of a SIGKILLed server closes a moment before its process is seen to exit.
            with anyio.move_on_after(1.0):
                while not self._process_exited(handle):  # noqa: ASYNC110 - no exit event to wait on
                    await anyio.sleep(0.05)
            return False
        except EngineError:
            return False
        return True

    def _process_exited(self, handle: EngineHandle) -> bool:
        """Launched engines only: if its process has exited, mark it dead (with the status) and say so."""
        if not handle.launched or handle.process is None:
            return False
        code = handle.process.exit_code()
        if code is None:
            return False
        self.mark_dead(handle, f"process exited with status {code}")
        return True

    async def relaunch(
        self,
        handle: EngineHandle,
        *,
        model_path: str | None = None,
        weight_version: str | None = None,
        timeout: float | None = None,
        admit: Admit | None = None,
    ) -> bool:
        """Bring a dead engine back; True when this call did, False when another caller did while it waited.

        A launched engine is stopped and started again (same port if it can) from the group's spec, with
        `model_path` / `weight_version` (`--weight-version`) for this incarnation when given; an external one
        stays DEAD until it answers (within `timeout`, default the attach timeout; it cannot take other
        weights at start: give `admit` instead).
        `admit(handle)` runs once the engine answers and before it is marked ALIVE. On failure the engine
        stays DEAD and the error is raised. Concurrent calls for the same handle run it once.
        """
        if not self._running:
            raise RuntimeError(f"fleet {self.group} is not running: relaunch needs run() to own the process")
        if handle not in self.engines:
            raise ValueError(f"{handle.name} is not an engine of fleet {self.group}")
        if not handle.launched and handle.node is None and (model_path is not None or weight_version is not None):
            raise ValueError(f"{handle.name} is an external engine: it cannot be relaunched with other weights")
        incarnation = handle.incarnation
        async with handle._lock:
            if handle.incarnation != incarnation and handle.state is EngineState.ALIVE:
                return False  # someone else relaunched it while we waited for the lock
            try:
                if handle.launched:
                    await self._restart(handle, self._spec_for(handle.name, model_path, weight_version), timeout,
                                        admit)
                elif handle.node is not None:
                    assert self.remote is not None
                    await self.remote.request_relaunch(handle.name, serial=handle.remote_serial,
                                                       model_path=model_path, weight_version=weight_version)
                    await self._bring_up(handle, timeout if timeout is not None else self.attach_timeout,
                                         admit=admit)
                else:
                    await self._bring_up(handle, timeout if timeout is not None else self.attach_timeout,
                                         admit=admit)
            except BaseException as exc:  # cancellation included: the handle must not stay STARTING
                self._set(handle, EngineState.DEAD, f"relaunch failed: {exc!r}"[:500])
                raise
        return True

    async def _restart(self, handle: EngineHandle, spec: EngineLaunchSpec, timeout: float | None,
                       admit: Admit | None) -> None:
        """Stop the launched engine's process and start a new incarnation from `spec` (same port if free)."""
        assert handle.process is not None
        await handle.process.stop()
        port = handle.process.port
        handle.process = self._process(handle.name, spec)
        with anyio.fail_after(timeout):
            await self._bring_up(handle, self.attach_timeout, port=port, admit=admit)
        if not self._running:  # the fleet stopped while we started it: nobody would end it
            await handle.process.stop()
            raise RuntimeError(f"fleet {self.group} stopped while {handle.name} was relaunched")

    async def for_each_alive(
        self, fn: Callable[[EngineHandle], Awaitable[T]], *, return_exceptions: bool = False
    ) -> dict[str, T | Exception]:
        """Run `fn(handle)` concurrently on every alive engine; results by engine name.

        With return_exceptions=True one engine's failure is returned in its slot and the others finish
        (weight sync must not abort a healthy engine's update because another one failed); otherwise the
        first failure cancels the rest and propagates.
        """
        results: dict[str, Any] = {}

        async def one(h: EngineHandle) -> None:
            try:
                results[h.name] = await fn(h)
            except Exception as exc:
                if not return_exceptions:
                    raise
                results[h.name] = exc

        async with anyio.create_task_group() as tg:
            for h in self.alive():
                tg.start_soon(one, h)
        return results


def _per_engine(launch: EngineLaunchSpec | Sequence[EngineLaunchSpec] | None, num_engines: int | None,
                group: str) -> list[EngineLaunchSpec]:
    """One spec per launched engine: the list given, or the one spec repeated `num_engines` times."""
    if launch is None or isinstance(launch, EngineLaunchSpec):
        count = num_engines or 0
        if count < 0:
            raise ValueError(f"num_engines must be >= 0, got {count}")
        if count and launch is None:
            raise ValueError(f"{group}: {count} local engines requested but no launch spec given")
        return [launch] * count if launch is not None else []
    specs = list(launch)
    if num_engines is not None and num_engines != len(specs):
        raise ValueError(f"{group}: num_engines {num_engines} does not match the {len(specs)} launch specs given")
    return specs


def spec_for_incarnation(spec: EngineLaunchSpec, model_path: str | None,
                         weight_version: str | None) -> EngineLaunchSpec:
    """An engine's spec with one incarnation's weights: a new frozen spec, the engine's own untouched."""
    if model_path is not None:
        spec = dataclasses.replace(spec, model_path=model_path)
    if weight_version is not None:
        spec = dataclasses.replace(spec, extra_args=_with_flag(spec.extra_args, "--weight-version", weight_version))
    return spec


def _with_flag(args: Sequence[str], flag: str, value: str) -> tuple[str, ...]:
    """`args` with `flag value` set: the value after an existing `flag` replaced, else both appended."""
    out = list(args)
    if flag not in out:
        return (*out, flag, value)
    index = out.index(flag)
    if index + 1 < len(out):
        out[index + 1] = value
    else:
        out.append(value)
    return tuple(out)

