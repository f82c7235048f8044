"""Rollout fault tolerance: the HealthMonitor of one engine group, and the fault-injection switch.

Owns, per engine group, the decision that an engine is dead and when to recover it: concurrent `/health_generate`
probes on a fixed cadence, consecutive failures counted, then `fleet.mark_dead` and the group's `EngineRecovery`
(retried every interval until the engine is back). Design: docs/fault-tolerance.md.

Invariants:
- A monitor exists only when `Config.health_monitor_enabled`; this module never re-derives that gate.
- With failure threshold N a hung engine is marked dead at most N·interval + timeout after it hung, whatever the
  number of engines (probes never wait for each other).
- A probe that overlapped a weight update, an eval pin or a colocation swap counts neither way, and none starts
  during one; a "released" answer (503 MemoryReleased) is alive; a timed-out probe whose `/metrics` counters moved
  is slow, not failed.
- A recovered engine serves the current weight version before it is back in dispatch (`EngineRecovery` and
  `WeightSync.admit` keep this; this module only decides when).
- `FaultInjector.pending` is always initialised (False when not armed); it kills one engine once.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import anyio
import anyio.abc

from coordinator.engines.client import EngineClient
from coordinator.engines.errors import EngineError, EngineHTTPError, EngineTimeout
from coordinator.engines.fleet import EngineFleet, EngineHandle, EngineState
from coordinator.engines.policy import NO_RETRY
from coordinator.engines.recovery import EngineRecovery, RouterLike
from coordinator.observe.timeline import span

if TYPE_CHECKING:
    from coordinator.config import Config, FaultToleranceConfig

log = logging.getLogger(__name__)

_PROGRESS_METRICS = ("sglang:num_requests_total", "sglang:generation_tokens_total")
_METRIC_LINE = re.compile(r"^(sglang:[a-z_]+)(?:\{[^}]*\})?\s+([-+0-9.eEinfa]+)\s*$")


class Pausing(Protocol):
    """Something that must not be disturbed by probes while it works: `updating` is set when idle.

    WeightSync (training weight updates), EvalFleet (pinning a snapshot) and Colocation (engines released or
    taking their memory back) provide it.
    """

    @property
    def updating(self) -> anyio.Event: ...


@dataclass
class MonitorStats:
    """What one monitor did, counted (tests and the run summary read these)."""

    probes: int = 0
    probe_failures: int = 0
    slow: int = 0
    discarded: int = 0
    #: probes answered "memory released": alive, neither a success nor a failure
    released: int = 0
    deaths: int = 0
    recoveries: int = 0
    recovery_errors: int = 0


@dataclass
class HealthEvent:
    at: float
    engine: str
    kind: str  # "dead" | "recovered" | "recovery_failed" | "slow"
    detail: str


@dataclass
class _Watch:
    """Probe state of one engine during one incarnation."""

    failures: int = 0
    last_progress: float | None = None
    dead: bool = False
    probe_starts: list[float] = field(default_factory=list)


class HealthMonitor:
    """Watches one engine group. Start with `await task_group.start(monitor.run)`.

    Args:
        fleet: the group's EngineFleet (the only owner of engine states).
        client: the shared engine client.
        interval / timeout / first_wait / failure_threshold: `--rollout-health-check-*`.
        recovery: the group's EngineRecovery (the rollout group's is its WeightSync's `recovery`, which also
            pauses probing during updates). None: a recovery without weights or router (the eval engines).
        pauses: further objects whose `updating` event pauses probing (the EvalFleet while it pins).
        relaunch_timeout: bound on one relaunch (None: the launch spec's own, or the fleet's attach timeout).
    """

    def __init__(
        self,
        *,
        fleet: EngineFleet,
        client: EngineClient,
        interval: float,
        timeout: float,
        first_wait: float = 0.0,
        failure_threshold: int = 2,
        recovery: EngineRecovery | None = None,
        pauses: Sequence[Pausing] = (),
        relaunch_timeout: float | None = None,
    ) -> None:
        if interval <= 0 or timeout <= 0:
            raise ValueError(
                f"--rollout-health-check-interval ({interval}) and --rollout-health-check-timeout ({timeout}) "
                "must be positive"
            )
        if failure_threshold < 1:
            raise ValueError(f"--rollout-health-check-failure-threshold must be >= 1, got {failure_threshold}")
        self.fleet = fleet
        self.client = client
        self.interval = interval
        self.timeout = timeout
        self.first_wait = max(0.0, first_wait)
        self.failure_threshold = failure_threshold
        self.recovery = recovery if recovery is not None else EngineRecovery(fleet=fleet)
        if self.recovery.fleet is not fleet:
            raise ValueError(f"the recovery of fleet {self.recovery.fleet.group} cannot recover the engines of "
                             f"fleet {fleet.group}")
        self.pauses: list[Pausing] = list(pauses)
        if self.recovery.weights is not None:
            self.pauses.append(self.recovery.weights)  # no probe overlaps a weight update
        self.relaunch_timeout = relaunch_timeout
        self.stats = MonitorStats()
        self.events: list[HealthEvent] = []
        self.watches: dict[str, _Watch] = {}
        self._declared: set[str] = set()

    @property
    def group(self) -> str:
        return self.fleet.group

    @property
    def detection_bound(self) -> float:
        """Longest time from an engine hanging to it being marked dead: threshold·interval + timeout."""
        return self.failure_threshold * self.interval + self.timeout

    # -- lifetime ------------------------------------------------------------------------------------

    async def run(self, *, task_status: anyio.abc.TaskStatus[HealthMonitor] = anyio.TASK_STATUS_IGNORED) -> None:
        """One watcher per engine (they never wait for each other); runs until cancelled."""
        log.info("health monitor of %s engines: probe every %.1fs (timeout %.1fs), dead after %d failures",
                 self.group, self.interval, self.timeout, self.failure_threshold)
        async with anyio.create_task_group() as tg:
            for handle in self.fleet.engines:
                tg.start_soon(self._watch, handle)
            task_status.started(self)

    async def _watch(self, handle: EngineHandle) -> None:
        while True:
            if handle.state is EngineState.DEAD:
                await self._recover(handle)
                continue
            if handle.state is EngineState.STARTING:
                await self.fleet.wait_changed()  # someone else (weight sync's recovery) is starting it
                continue
            await anyio.sleep(self.first_wait)  # grace after a (re)start: engines warm up
            if handle.state is EngineState.ALIVE:
                await self._probe_while_alive(handle)

    async def _probe_while_alive(self, handle: EngineHandle) -> None:
        """Probe on a fixed cadence until the engine leaves ALIVE (marked dead by us or by the dispatcher)."""
        watch = self.watches[handle.name] = _Watch()
        incarnation = handle.incarnation
        async with anyio.create_task_group() as tg:

            async def stop_when_not_alive() -> None:
                while handle.state is EngineState.ALIVE and handle.incarnation == incarnation:
                    await self.fleet.wait_changed()
                tg.cancel_scope.cancel()

            tg.start_soon(stop_when_not_alive)
            while True:
                await self._wait_not_paused()
                tg.start_soon(self._probe, handle, watch)
                await anyio.sleep(self.interval)

    async def _wait_not_paused(self) -> None:
        for pausing in self.pauses:
            while not pausing.updating.is_set():
                await pausing.updating.wait()

    def _pause_marks(self) -> list[tuple[int, bool]]:
        return [(id(p.updating), p.updating.is_set()) for p in self.pauses]

    # -- probing -------------------------------------------------------------------------------------

    async def _probe(self, handle: EngineHandle, watch: _Watch) -> None:
        marks = self._pause_marks()
        watch.probe_starts.append(time.monotonic())
        self.stats.probes += 1
        url = handle.url
        api = self.client.engine(url)
        health_error: EngineError | None = None
        progress: float | None = None

        async def health() -> None:
            nonlocal health_error
            try:
                with anyio.fail_after(self.timeout):
                    await api.health_generate(timeout=self.timeout, retry=NO_RETRY)
            except TimeoutError:
                health_error = EngineTimeout(url, self.timeout, "probe deadline")
            except EngineError as error:
                health_error = error

        async def metrics() -> None:
            nonlocal progress
            with anyio.move_on_after(self.timeout):
                try:
                    progress = _progress_counter(await api.metrics(timeout=self.timeout, retry=NO_RETRY))
                except EngineError:
                    progress = None

        with span("health probe", ("health", handle.name), lanes=True):  # a slow probe overlaps the next
            async with anyio.create_task_group() as tg:
                tg.start_soon(health)
                tg.start_soon(metrics)
        if self._pause_marks() != marks or not all(set_ for _, set_ in marks):
            self.stats.discarded += 1  # overlapped a weight update or a pin: says nothing about health
            return
        if handle.state is not EngineState.ALIVE or watch.dead:
            return
        previous = watch.last_progress
        if progress is not None:
            watch.last_progress = progress
        if health_error is None:
            watch.failures = 0
            return
        if isinstance(health_error, EngineHTTPError) and health_error.released:
            self.stats.released += 1  # alive with its memory released (not by us: we pause during a swap)
            return
        if (isinstance(health_error, EngineTimeout) and progress is not None and previous is not None
                and progress > previous):
            # Requests kept finishing while the probe waited: overloaded, not hung.
            self.stats.slow += 1
            self.events.append(HealthEvent(time.monotonic(), handle.name, "slow", str(health_error)))
            return
        watch.failures += 1
        self.stats.probe_failures += 1
        if watch.failures >= self.failure_threshold and not watch.dead:
            watch.dead = True
            reason = (f"{watch.failures} consecutive health checks failed "
                      f"({'no progress' if progress is not None else 'metrics unanswered'}): {health_error}")
            self._declare_dead(handle, reason)

    def _declare_dead(self, handle: EngineHandle, reason: str) -> None:
        log.warning("engine %s is dead: %s", handle.name, reason)
        self._declared.add(handle.name)
        self.stats.deaths += 1
        self.events.append(HealthEvent(time.monotonic(), handle.name, "dead", reason))
        self.fleet.mark_dead(handle, reason)

    # -- recovery ------------------------------------------------------------------------------------

    async def _recover(self, handle: EngineHandle) -> None:
        """Bring a dead engine back with the current weights; on failure wait one interval and try again."""
        if handle.name not in self._declared:
            # Marked dead by someone else (the dispatcher saw a request fail): count it here too.
            self.stats.deaths += 1
            self.events.append(HealthEvent(time.monotonic(), handle.name, "dead", handle.dead_reason or ""))
        while handle.state is EngineState.DEAD:
            await self._wait_not_paused()
            try:
                with span("recovery", ("health", f"{handle.name} recovery")):
                    await self.recovery.recover(handle, timeout=self.relaunch_timeout)
            except Exception as error:  # a failed recovery is retried; the run goes on with the others
                self.stats.recovery_errors += 1
                self.events.append(HealthEvent(time.monotonic(), handle.name, "recovery_failed", repr(error)))
                log.warning("recovery of engine %s failed (%r); retrying in %.1fs", handle.name, error,
                            self.interval)
                await anyio.sleep(self.interval)
        self._declared.discard(handle.name)
        if handle.state is EngineState.ALIVE:
            self.stats.recoveries += 1
            self.events.append(HealthEvent(time.monotonic(), handle.name, "recovered",
                                           f"incarnation {handle.incarnation} at {handle.url}"))
            log.info("engine %s is back at %s (weight version %s)", handle.name, handle.url,
                     self.recovery.current_version or "initial")


def _progress_counter(text: str) -> float | None:
    """Requests + tokens generated so far, from Prometheus text; None when the engine does not report them."""
    total = 0.0
    found = False
    for line in text.splitlines():
        match = _METRIC_LINE.match(line.strip())
        if match and match.group(1) in _PROGRESS_METRICS:
            try:
                total += float(match.group(2))
                found = True
            except ValueError:
                continue
    return total if found else None


# ----------------------------------------------------------------------------------------------------------
# Wiring: which monitors exist (read from Config's derived facts only)
# ----------------------------------------------------------------------------------------------------------


def build_health_monitors(
    settings: FaultToleranceConfig,
    *,
    enabled: bool,
    client: EngineClient,
    rollout_fleet: EngineFleet | None,
    rollout_recovery: EngineRecovery | None = None,
    router: RouterLike | None = None,
    eval_fleet: EngineFleet | None = None,
    eval_pauses: Sequence[Pausing] = (),
    rollout_pauses: Sequence[Pausing] = (),
) -> list[HealthMonitor]:
    """One monitor per engine group, only when `enabled` (`Config.health_monitor_enabled`); [] otherwise.

    The rollout monitor recovers through `rollout_recovery` (in a training run the weight sync's, so a
    recovered engine gets the current weights; built with the router) or, in a run without training, a
    recovery of its own that keeps the router up to date; it pauses for `rollout_pauses` too (the colocation
    swap)."""
    if not enabled:
        return []
    probing = dict(
        client=client,
        interval=settings.rollout_health_check_interval,
        timeout=settings.rollout_health_check_timeout,
        first_wait=settings.rollout_health_check_first_wait,
        failure_threshold=settings.rollout_health_check_failure_threshold,
    )
    monitors = []
    if rollout_fleet is not None:
        recovery = rollout_recovery or EngineRecovery(fleet=rollout_fleet, router=router)
        monitors.append(HealthMonitor(fleet=rollout_fleet, recovery=recovery, pauses=rollout_pauses, **probing))
    if eval_fleet is not None:
        # Eval engines never receive training weights: a recovered one is re-pinned by the next eval.
        monitors.append(HealthMonitor(fleet=eval_fleet, pauses=eval_pauses, **probing))
    return monitors


# ----------------------------------------------------------------------------------------------------------
# Fault injection
# ----------------------------------------------------------------------------------------------------------


class FaultInjector:
    """`--inject-engine-fault-at-rollout N`: SIGKILL one launched rollout engine once, when rollout N starts.

    Armed only when `config.fault_injection_armed` (rollout FT on, engines exist). `pending` is always set
    (True while armed and not yet fired), so code reading it never meets a missing attribute.
    """

    def __init__(self, *, armed: bool, at_rollout: int | None, fleet: EngineFleet | None) -> None:
        self.armed = bool(armed and at_rollout is not None and fleet is not None)
        self.at_rollout = at_rollout
        self.fleet = fleet
        self.pending = self.armed
        self.killed: list[str] = []

    @classmethod
    def from_config(cls, config: Config, fleet: EngineFleet | None) -> FaultInjector:
        return cls(armed=config.fault_injection_armed, at_rollout=config.fault_injection_rollout,
                   fleet=fleet)

    def maybe_inject(self, rollout_id: int) -> str | None:
        """Kill the victim if this is the armed rollout; returns its name when it fired."""
        if not self.pending or rollout_id != self.at_rollout:
            return None
        assert self.fleet is not None
        victims = [h for h in self.fleet.alive() if h.launched and h.process is not None and h.process.pid]
        if not victims:
            log.warning("fault injection at rollout %d: no launched rollout engine is alive to kill", rollout_id)
            return None
        self.pending = False
        victim = victims[0]
        assert victim.process is not None and victim.process.pid is not None
        log.warning("fault injection: killing rollout engine %s (pid %d) at rollout %d", victim.name,
                    victim.process.pid, rollout_id)
        try:
            os.killpg(victim.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.killed.append(victim.name)
        return victim.name


class FaultInjectingSource:
    """The rollout source the training loop sees when an injector exists: fires it, then delegates."""

    def __init__(self, source: Any, injector: FaultInjector) -> None:
        self.source = source
        self.injector = injector

    async def get_rollout(self, rollout_id: int, weight_version: str) -> Any:
        self.injector.maybe_inject(rollout_id)
        return await self.source.get_rollout(rollout_id, weight_version)

    def state_dict(self) -> dict[str, Any]:
        return self.source.state_dict()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.source, name)
