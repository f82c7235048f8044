"""Engine recovery: the one path by which a dead engine comes back, whoever finds it dead.

Owns the steps from DEAD to back in dispatch for every caller (the HealthMonitor, WeightSync, the EvalFleet's
pin): out of the router, relaunched from the current snapshot with `--weight-version` set (or waited for, when
external), the current version loaded and checked by the weights' owner (`admit`), ALIVE, back in the router.
Design: docs/fault-tolerance.md.

Invariants:
- Only the fleet changes an engine's state or process; this module asks it through `relaunch`.
- One recovery of an engine at a time: a second caller waits for the first and returns False when it finds the
  engine no longer dead.
- A recovered engine reports the current weight version, at a moment no weight update runs, before it is ALIVE.
- The router loses a dead engine when its recovery starts and gets it back only once it is ALIVE.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Protocol

import anyio

from coordinator.engines.errors import EngineError
from coordinator.engines.fleet import EngineFleet, EngineHandle, EngineState

log = logging.getLogger(__name__)


class CurrentWeights(Protocol):
    """The owner of the weights engines must serve (WeightSync provides it)."""

    #: set while no weight update runs
    updating: anyio.Event

    @property
    def current_version(self) -> str | None: ...

    async def current_weights(self) -> tuple[Path, str] | None:
        """(snapshot directory, version) of the current weights; None while the engines' start weights are."""
        ...

    async def admit(self, engine: EngineHandle) -> None:
        """Make an engine that answers but is not in dispatch serve the current version, or raise."""
        ...


class RouterLike(Protocol):
    async def add_worker(self, url: str) -> None: ...

    async def remove_worker(self, url: str) -> None: ...


class EngineRecovery:
    """Recovers the engines of one group. `weights`: None for a group that never gets training weights (the
    eval engines, or a run without training); `router`: the group's RouterHandle with `--use-sglang-router`."""

    def __init__(
        self, *, fleet: EngineFleet, weights: CurrentWeights | None = None, router: RouterLike | None = None
    ) -> None:
        self.fleet = fleet
        self.weights = weights
        self.router = router
        self._locks: dict[str, anyio.Lock] = {}
        self._out_of_router: dict[str, str] = {}  # engine name -> the URL removed from the router

    @property
    def current_version(self) -> str | None:
        return None if self.weights is None else self.weights.current_version

    async def recover(self, handle: EngineHandle, *, timeout: float | None = None) -> bool:
        """Bring `handle` back with the current weights; True when this call did, False when it was not dead
        (another caller recovered it). Raises when it could not: the engine stays DEAD, a later call retries.

        `timeout` bounds the relaunch (None: the launch spec's start timeout, or for an external engine the
        fleet's attach timeout).
        """
        lock = self._locks.setdefault(handle.name, anyio.Lock())
        async with lock:
            if handle.state is not EngineState.DEAD:
                return False
            await self._leave_router(handle)
            model_path = version = None
            if handle.launched and self.weights is not None:
                current = await self.weights.current_weights()
                if current is not None:
                    model_path, version = str(current[0]), current[1]
            brought_back = await self.fleet.relaunch(
                handle, model_path=model_path, weight_version=version, timeout=timeout,
                admit=None if self.weights is None else self.weights.admit,
            )
            await self._join_router(handle)
            return brought_back

    async def _leave_router(self, handle: EngineHandle) -> None:
        if self.router is None or handle.name in self._out_of_router:
            return
        self._out_of_router[handle.name] = handle.url
        await self._router_change(self.router.remove_worker, handle.url, "remove")

    async def _join_router(self, handle: EngineHandle) -> None:
        if self.router is None or self._out_of_router.pop(handle.name, None) is None:
            return
        await self._router_change(self.router.add_worker, handle.url, "add")

    @staticmethod
    async def _router_change(change: Callable[[str], Awaitable[None]], url: str, what: str) -> None:
        from coordinator.engines.router import RouterError

        try:
            await change(url)
        except (RouterError, EngineError) as error:
            log.warning("router: could not %s worker %s: %s", what, url, error)
