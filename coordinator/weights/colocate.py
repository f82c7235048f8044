"""Colocation: the memory hand-over between the rollout engines and the training ranks, every step.

Owns the order of the swap (generate → release → onload → train → export → offload → resume_weights → update →
resume_kv), its per-phase seconds and memory figures (`colocate/<phase>_s`, `swap_s`, `swap_share`), and which
engines it released. The loop calls `before_train`, `during_train`, `after_train`, `after_update`; `rayless
train` calls `release_at_startup` and `settle_at_startup`. The schedule: docs/colocation.md.

Invariants:
- Nothing is sent to a released engine: the loop generates only after `after_update`, the health monitor does
  not probe from the first release to the last resume, and an engine is released only when idle.
- Only the incarnation that was released is resumed.
- An engine that died while released or resuming is marked dead here and recovered by the one recovery path
  (with rollout FT); without rollout FT the run stops naming it.
- A snapshot exported before a rank recovery is dropped, so the engines get what the ranks hold.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any, Protocol

import anyio

from coordinator.engines.client import EngineClient
from coordinator.engines.errors import EngineError, EngineHTTPError
from coordinator.engines.fleet import EngineFleet, EngineHandle
from coordinator.observe.timeline import span
from workers.errors import RaylessError

log = logging.getLogger("rayless")

#: SGLang 0.5.x's memory tags (`/release_memory_occupation`); the weights come back before the update, the rest
#: after it
WEIGHT_TAGS = ("weights",)
CACHE_TAGS = ("kv_cache", "cuda_graph")
#: the phases whose seconds are the price of sharing the GPUs
SWAP_PHASES = ("release", "onload", "export", "offload", "resume_weights", "resume_kv")


class ColocationError(RaylessError, RuntimeError):
    """An engine could not release or take back its memory and no recovery applies; names the engine."""


class MovedState(Protocol):
    """One offload/onload over the ranks (`coordinator.train.commands.StateMoves`)."""

    def figures(self) -> dict[str, int]: ...


class StateMover(Protocol):
    """The training ranks' side (`TrainGroup.commands`)."""

    async def offload(self, rollout_id: int = -1, *, verify: bool = False) -> MovedState: ...

    async def onload(self, rollout_id: int = -1, *, verify: bool = False) -> MovedState: ...

    @property
    def recoveries(self) -> int: ...


class AheadExport(Protocol):
    """The weight sync's side (WeightSync): a snapshot written before the ranks offload."""

    async def prepare(self, version: str) -> dict[str, float]: ...

    def discard_prepared(self) -> None: ...


class Colocation:
    """The swap of one run. `offload_train` / `offload_rollout`: the plan's `SwapPlan`; `recovers_engines`:
    rollout FT is on (WeightSync then relaunches an engine that died while released)."""

    def __init__(self, *, fleet: EngineFleet, client: EngineClient, trainer: StateMover,
                 weight_sync: AheadExport | None, offload_train: bool, offload_rollout: bool,
                 recovers_engines: bool, on_phase: Callable[[str], None] | None = None) -> None:
        self.fleet = fleet
        self.client = client
        self.trainer = trainer
        self.weight_sync = weight_sync
        self.offload_train = offload_train
        self.offload_rollout = offload_rollout
        self.recovers_engines = recovers_engines
        #: called with each phase as it begins (the run bar); tests add their own
        self.observers: list[Callable[[str], None]] = [on_phase] if on_phase is not None else []
        #: set while no swap runs (the health monitor waits on it: `coordinator.engines.health.Pausing`)
        self.updating = anyio.Event()
        self.updating.set()
        #: set once the engines released their memory at start-up (the ranks load the model only then)
        self.startup_released = anyio.Event()
        self.phase = "generate"
        self.deaths: list[str] = []
        self._released: dict[str, int] = {}  # engine name -> the incarnation released
        self._seconds: dict[str, float] = {}
        self._figures: dict[str, float] = {}
        self._step_started = time.monotonic()
        self._update_started = time.monotonic()
        self._step_deaths: list[str] = []

    def released_engines(self) -> frozenset[str]:
        """The engines whose memory is released now (the status server's "released"): those this swap
        released, same incarnation, while the swap is on (`updating` clear)."""
        if self.updating.is_set():
            return frozenset()
        return frozenset(h.name for h in self.fleet.alive() if self._released.get(h.name) == h.incarnation)

    # -- start-up --------------------------------------------------------------------------------------

    async def release_at_startup(self) -> None:
        """Engines are up: release their memory, so the ranks load the model into it."""
        try:
            if self.offload_rollout:
                self.updating = anyio.Event()
                await self._release()
        finally:
            self.startup_released.set()

    async def settle_at_startup(self) -> None:
        """Ranks are ready: they offload, the engines take everything back and generate."""
        if self.offload_train:
            await self.trainer.offload()
        if self.offload_rollout:
            await self._resume(WEIGHT_TAGS + CACHE_TAGS)
            self._check_deaths()
        self.updating.set()

    # -- one step ---------------------------------------------------------------------------------------

    async def before_train(self, rollout_id: int, generate_s: float) -> dict[str, float]:
        """Generation is done: engines release, ranks bring their state back."""
        self._seconds = {"generate": generate_s}
        self._figures = {}
        self._step_deaths = []
        self._step_started = time.monotonic() - generate_s
        self.updating = anyio.Event()
        await self._sample_engines("generate")
        if self.offload_rollout:
            async with self._timed("release"):
                await self._release()
        if self.offload_train:
            async with self._timed("onload"):
                moved = await self.trainer.onload(rollout_id)
            self._rank_figures("onload", moved)
        self._enter("train")
        return {}

    async def during_train(self) -> None:
        """Run beside the train step: what the engines hold while the ranks train."""
        await self._sample_engines("train")

    async def after_train(self, rollout_id: int, version: str, train_s: float) -> dict[str, float]:
        """Trained: the new weights' snapshot is written while the ranks hold them, then the ranks offload and
        the engines take their weights back (for the update)."""
        self._seconds["train"] = train_s
        record: dict[str, float] = {}
        recoveries = self.trainer.recoveries
        if self.weight_sync is not None and self.offload_train:
            async with self._timed("export"):
                record.update(await self.weight_sync.prepare(version))
        if self.offload_train:
            async with self._timed("offload"):
                moved = await self.trainer.offload(rollout_id)
            self._rank_figures("offload", moved)
            if self.trainer.recoveries != recoveries and self.weight_sync is not None:
                self.weight_sync.discard_prepared()  # train FT restored the ranks: export what they hold now
        if self.offload_rollout:
            async with self._timed("resume_weights"):
                await self._resume(WEIGHT_TAGS)
            self._check_deaths()
        self._enter("update")
        self._update_started = time.monotonic()
        return record

    async def after_update(self) -> dict[str, float]:
        """Updated: the engines take their KV cache back and generate again. Returns the step's figures."""
        self._seconds["update"] = time.monotonic() - self._update_started
        if self.offload_rollout:
            async with self._timed("resume_kv"):
                await self._resume(CACHE_TAGS)
            self._check_deaths()
        await self._sample_engines("resumed")
        self.updating.set()
        self._enter("generate")
        step_s = time.monotonic() - self._step_started
        swap_s = sum(self._seconds.get(phase, 0.0) for phase in SWAP_PHASES)
        record = {f"colocate/{phase}_s": seconds for phase, seconds in self._seconds.items()}
        record.update({"colocate/swap_s": swap_s, "colocate/swap_share": swap_s / step_s if step_s > 0 else 0.0,
                       **self._figures})
        return record

    # -- engines ----------------------------------------------------------------------------------------

    async def _release(self) -> None:
        """Every alive engine: generation paused (abort: a released engine must be idle), memory released."""
        self._released = {}

        async def one(handle: EngineHandle) -> None:
            api = self.client.engine(handle.url)
            await api.pause_generation("abort")
            await api.release_memory_occupation(list(WEIGHT_TAGS + CACHE_TAGS))
            self._released[handle.name] = handle.incarnation

        await self._each(list(self.fleet.alive()), one, "release its memory")

    async def _resume(self, tags: tuple[str, ...]) -> None:
        """The engines released by this swap (same incarnation, still alive) take `tags` back; after the KV
        cache, generation continues."""
        engines = [h for h in self.fleet.alive() if self._released.get(h.name) == h.incarnation]

        async def one(handle: EngineHandle) -> None:
            api = self.client.engine(handle.url)
            await api.resume_memory_occupation(list(tags))
            if "kv_cache" in tags:
                await api.continue_generation()

        await self._each(engines, one, f"take back {', '.join(tags)}")

    async def _each(self, engines: list[EngineHandle], fn: Callable[[EngineHandle], Any], what: str) -> None:
        """`fn` on every engine at once; an engine that cannot be reached (it died) is marked dead."""
        failures: dict[str, EngineError] = {}

        async def one(handle: EngineHandle) -> None:
            try:
                await fn(handle)
            except EngineError as error:
                failures[handle.name] = error

        async with anyio.create_task_group() as group:
            for handle in engines:
                group.start_soon(one, handle)
        for handle in engines:
            error = failures.get(handle.name)
            if error is None:
                continue
            if isinstance(error, EngineHTTPError) and not self._exited(handle):
                raise ColocationError(f"engine {handle.name} could not {what}: {error}")
            reason = f"died while its memory was swapped (could not {what}: {error})"
            log.warning("colocation: engine %s %s", handle.name, reason)
            self.deaths.append(handle.name)
            self._step_deaths.append(handle.name)
            self.fleet.mark_dead(handle, reason)
            self._released.pop(handle.name, None)

    @staticmethod
    def _exited(handle: EngineHandle) -> bool:
        return handle.process is not None and handle.process.exit_code() is not None

    def _check_deaths(self) -> None:
        dead = sorted(set(self._step_deaths))
        if dead and not self.recovers_engines:
            raise ColocationError(f"rollout engine(s) {', '.join(dead)} died while their memory was released; "
                                  "with --use-fault-tolerance --ft-components rollout they are relaunched with the "
                                  "current weights")

    async def _sample_engines(self, phase: str) -> None:
        """What each engine holds now (`/server_info`), summed over the engines: resident set, weight bytes,
        CUDA memory, requests refused while released (cumulative)."""
        sums: dict[str, float] = {}

        async def one(handle: EngineHandle) -> None:
            try:
                with anyio.fail_after(10):
                    info = await self.client.engine(handle.url).server_info()
            except (EngineError, TimeoutError):
                return
            states = info.get("internal_states") or [{}]
            state = states[0] if isinstance(states, list) and states and isinstance(states[0], dict) else {}
            for key, name in (("rss_bytes", "rss"), ("weight_bytes_resident", "weight"),
                              ("cuda_memory_allocated", "cuda_allocated"), ("cuda_memory_reserved", "cuda_reserved"),
                              ("requests_refused_while_released", "requests_refused_while_released")):
                value = state.get(key)
                if isinstance(value, int | float):
                    sums[name] = sums.get(name, 0.0) + float(value)

        async with anyio.create_task_group() as group:
            for handle in self.fleet.alive():
                group.start_soon(one, handle)
        for name, value in sums.items():
            key = (f"colocate/engine_{name}" if name == "requests_refused_while_released"
                   else f"colocate/engine_{name}_{phase}_bytes")
            self._figures[key] = value

    # -- ranks and phases --------------------------------------------------------------------------------

    def _rank_figures(self, move: str, moved: MovedState) -> None:
        for key, value in moved.figures().items():
            self._figures[f"colocate/rank_{move}_{key}"] = float(value)

    def _enter(self, phase: str) -> None:
        self.phase = phase
        for observer in self.observers:
            observer(phase)

    @asynccontextmanager
    async def _timed(self, phase: str) -> AsyncIterator[None]:
        """Enter `phase`; its seconds go to the step's `colocate/<phase>_s`."""
        self._enter(phase)
        started = time.monotonic()
        try:
            with span(phase, ("colocation", "swap")):
                yield
        finally:
            self._seconds[phase] = self._seconds.get(phase, 0.0) + time.monotonic() - started


