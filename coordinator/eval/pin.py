"""Pinning the eval engines to one weight snapshot, for one evaluation at a time.

Owns what the eval engines serve: `EvalPin.pin(snapshot, version)` loads one snapshot on every alive eval
engine and checks it; `PinnedPool` is the set of engines one evaluation may then use. Design:
docs/evaluation.md.

Invariants:
- `pin()` waits for *every* eval engine (bringing dead ones back through `EngineRecovery` when no monitor
  watches them) and raises `EvalSkip("unhealthy")` naming the missing ones, unless `allow_partial=True`.
- `pin()` returns only when every engine it pinned reports the pinned version and answered a 1-token
  generate; otherwise `EvalSkip("unhealthy" | "pin_violation")`.
- It probes exactly when no monitor watches the engines (`probe_before_pin`).
- While a pin loads weights its `updating` event is clear; an engine relaunched after a pin is not in its pool.
- Every engine call of a pin (load, version, 1-token generate) ends within `timeout` (`acknowledged`): an engine
  past it is named with the call and the time waited in the skip's reason (`EngineOverdue`).
"""

from __future__ import annotations

import logging
from typing import Any

import anyio

from coordinator.engines.client import EngineClient
from coordinator.engines.deadline import acknowledged, read_timeout
from coordinator.engines.errors import EngineError
from coordinator.engines.fleet import EngineFleet, EngineHandle, EngineState
from coordinator.engines.policy import NO_RETRY
from coordinator.engines.recovery import EngineRecovery

log = logging.getLogger(__name__)


#: where a pin's per-call bound comes from (named in an overdue engine's message)
PIN_BOUND = "the eval pin's per-call bound"


class EvalSkip(Exception):
    """An evaluation that did not run, with miles' reason (logged as `eval/skipped_<reason>`): "unhealthy" and
    "pin_violation" (the pin), "busy" (over `--eval-max-in-flight` with `--eval-overflow-policy skip`),
    "export_failed" (its snapshot could not be written), "crashed" (the evaluation raised); or, with `backend`,
    the reason a `CheckpointEvalFn`'s own `EvalSkip(reason)` gave (miles logs any)."""

    REASONS = ("unhealthy", "pin_violation", "busy", "export_failed", "crashed")

    def __init__(self, reason: str, detail: str = "", *, backend: bool = False) -> None:
        if not backend and reason not in self.REASONS:
            raise ValueError(f"EvalSkip reason must be one of {self.REASONS}, got {reason!r}")
        super().__init__(f"eval skipped ({reason}){': ' + detail if detail else ''}")
        self.reason = reason
        self.detail = detail


class PinnedPool:
    """The engines one evaluation may use: those pinned by it, in the incarnation that was pinned (a
    relaunched engine serves the base weights until the next pin, so it is not used)."""

    def __init__(self, fleet: EngineFleet, pinned: dict[str, int]) -> None:
        self.fleet = fleet
        self.pinned = pinned

    def alive(self) -> list[EngineHandle]:
        return [h for h in self.fleet.alive() if self.pinned.get(h.name) == h.incarnation]

    async def check(self, handle: EngineHandle) -> bool:
        return await self.fleet.check(handle)

    async def wait_any_alive(self, timeout: float) -> list[EngineHandle]:
        with anyio.fail_after(timeout):
            while not (alive := self.alive()):
                await self.fleet.wait_changed()
        return alive

    def mark_dead(self, handle: EngineHandle, reason: str) -> None:
        self.fleet.mark_dead(handle, reason)

    async def wait_changed(self) -> None:
        await self.fleet.wait_changed()


class EvalPin:
    """Loads one snapshot into the eval engines per evaluation.

    Args:
        fleet: the EngineFleet of group "eval".
        client: the shared engine client.
        probe_before_pin: True when no HealthMonitor watches the eval engines.
        pin_wait: seconds `pin()` waits for dead engines to come back (recovering them itself, or the monitor).
        timeout: bound on each engine call during a pin (load, version, 1-token generate).
        allow_partial: go on with the alive engines when not all came back within `pin_wait` (at least one);
            otherwise such a pin is skipped as unhealthy.
    """

    def __init__(self, *, fleet: EngineFleet, client: EngineClient, probe_before_pin: bool, pin_wait: float,
                 timeout: float, allow_partial: bool = False) -> None:
        self.fleet = fleet
        self.client = client
        self.probe_before_pin = probe_before_pin
        self.pin_wait = pin_wait
        self.timeout = timeout
        self.allow_partial = allow_partial
        self.recovery = EngineRecovery(fleet=fleet)  # used only while no monitor watches these engines
        # Pausing protocol for the eval group's HealthMonitor: set = not pinning.
        self.updating = anyio.Event()
        self.updating.set()
        self.probes = 0  # engine probes made by pin() itself (0 whenever a monitor watches the engines)
        self.pins = 0

    async def pin(self, checkpoint_dir: str, weight_version: str) -> dict[str, int]:
        """Make the eval engines serve `checkpoint_dir` as `weight_version`; returns {engine: incarnation}.

        Raises EvalSkip("unhealthy") when not every engine is alive after probing/recovering and `pin_wait`
        (with `allow_partial`: when none is), or one does not answer a 1-token generate;
        EvalSkip("pin_violation") when an engine does not report the version after a second load.
        """
        self.pins += 1
        if self.probe_before_pin:
            await self._probe_and_recover()
        alive = await self._wait_alive()
        self.updating = anyio.Event()  # the eval group's monitor (if any) must not probe a loading engine
        try:
            await self._load(alive, checkpoint_dir, weight_version)
            await self._one_token(alive)
        finally:
            self.updating.set()
        return {h.name: h.incarnation for h in alive}

    async def _probe_and_recover(self) -> None:
        async def probe(handle: EngineHandle) -> None:
            if handle.state is not EngineState.ALIVE:
                return
            self.probes += 1
            if not await self.fleet.check(handle):
                self.fleet.mark_dead(handle, "eval fleet probe before pinning failed")

        async def recover(handle: EngineHandle) -> None:
            try:
                await self.recovery.recover(handle, timeout=self.pin_wait)
            except Exception as error:  # the pin goes on with the others; none alive → unhealthy
                log.warning("eval engine %s could not be recovered: %r", handle.name, error)

        async with anyio.create_task_group() as tg:
            for handle in self.fleet.engines:
                tg.start_soon(probe, handle)
        async with anyio.create_task_group() as tg:
            for handle in self.fleet.engines:
                if handle.state is EngineState.DEAD:
                    tg.start_soon(recover, handle)

    async def _wait_alive(self) -> list[EngineHandle]:
        """Every engine alive (waiting up to `pin_wait` for the monitor when it recovers them), else
        unhealthy — unless `allow_partial`, which goes on with the alive ones (none: unhealthy)."""
        with anyio.move_on_after(0 if self.probe_before_pin else self.pin_wait):
            while len(self.fleet.alive()) < len(self.fleet.engines):
                await self.fleet.wait_changed()
        alive = self.fleet.alive()
        total = len(self.fleet.engines)
        if len(alive) == total:
            return alive
        missing = {h.name: h.dead_reason or h.state.value for h in self.fleet.engines if h not in alive}
        detail = (f"{len(alive)} of {total} eval engines alive after waiting {self.pin_wait:g} s for the others; "
                  f"not back: {missing}")
        if not alive or not self.allow_partial:
            if alive:
                detail += "; a partial eval fleet is not allowed"
            raise EvalSkip("unhealthy", detail)
        log.warning("evaluating on part of the eval fleet (allowed): %s", detail)
        return alive

    async def _load(self, engines: list[EngineHandle], checkpoint_dir: str, version: str) -> None:
        async def load(handle: EngineHandle) -> None:
            api = self.client.engine(handle.url)
            with acknowledged(handle.url, "POST /update_weights_from_disk", bound=self.timeout, flag=PIN_BOUND):
                await api.update_weights_from_disk(checkpoint_dir, weight_version=version, flush_cache=True,
                                                   timeout=read_timeout(self.timeout))

        async def version_of(handle: EngineHandle) -> str:
            with acknowledged(handle.url, "GET /get_weight_version", bound=self.timeout, flag=PIN_BOUND):
                return await self.client.engine(handle.url).get_weight_version(timeout=read_timeout(self.timeout))

        wrong = await self._for_each(engines, load, version_of, version)
        if wrong:
            log.warning("eval engines %s do not report version %s after the load; loading once more", wrong, version)
            wrong = await self._for_each([h for h in engines if h.name in wrong], load, version_of, version)
        if wrong:
            raise EvalSkip("pin_violation", f"engines report {wrong} instead of weight version {version!r}")

    async def _for_each(self, engines: list[EngineHandle], load: Any, version_of: Any, version: str) -> dict[str, str]:
        wrong: dict[str, str] = {}

        async def one(handle: EngineHandle) -> None:
            try:
                await load(handle)
                got = await version_of(handle)
            except EngineError as error:
                got = f"<load failed: {error}>"[:300]
            if got != version:
                wrong[handle.name] = got

        async with anyio.create_task_group() as tg:
            for handle in engines:
                tg.start_soon(one, handle)
        return wrong

    async def _one_token(self, engines: list[EngineHandle]) -> None:
        failed: dict[str, str] = {}

        async def one(handle: EngineHandle) -> None:
            payload = {"input_ids": [1], "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}}
            try:
                with acknowledged(handle.url, "POST /generate (1 token)", bound=self.timeout, flag=PIN_BOUND):
                    await self.client.engine(handle.url).generate(payload, timeout=read_timeout(self.timeout),
                                                                  retry=NO_RETRY)
            except EngineError as error:
                failed[handle.name] = str(error)[:300]

        async with anyio.create_task_group() as tg:
            for handle in engines:
                tg.start_soon(one, handle)
        if failed:
            raise EvalSkip("unhealthy", f"pinned engines did not answer a 1-token generate: {failed}")
