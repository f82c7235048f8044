"""Pushing trained weights to the rollout engines, and owning which weights are current.

Owns one weight update end to end — pause generation, move the weights (`disk`: a safetensors snapshot every
engine loads, or with `--update-weight-mode delta` the changed tensors, which our engines apply; `distributed`: buckets over a weight-update group, see `distributed_sync`), check every engine
reports the new version, continue generation, on every exit path — and the current weights (version and
snapshot: the only place rollout snapshots are exported) with the rollout group's `EngineRecovery`. Design:
docs/weight-sync.md.

Invariants:
- after `update()` returns, every engine it updated reports `version`; otherwise `WeightSyncError` names the
  engines that did not — or, with rollout FT (`recover_engines`), those engines are marked dead (recovery
  brings them back with the current weights) and the update goes on with the others, failing only when none
  is left;
- each engine's acknowledgment of a load (`/update_weights_from_disk`, in an update and in `admit`) is waited
  for at most `ack_timeout_s` (`--update-weight-ack-timeout`): past it, `EngineOverdue` names the engine, the
  call and the time waited;
- `current_weights()` never pairs a snapshot with another version's name;
- `admit()` returns only at a moment when the engine reports the current version and no update runs;
- dead rollout engines are recovered before an update only when rollout FT is on (`recover_engines`);
- a snapshot exported ahead (`prepare`, colocation) is what `update()` of that version loads;
- a delta is taken against a version every engine reported (`_delta_base`), else the update is a full one.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import anyio

from coordinator.config.sglang import TRANSFER_CARRIERS
from coordinator.engines.client import EngineClient
from coordinator.engines.deadline import acknowledged, read_timeout
from coordinator.engines.errors import EngineError
from coordinator.engines.fleet import EngineFleet, EngineHandle
from coordinator.engines.recovery import EngineRecovery, RouterLike
from coordinator.observe.timeline import span
from coordinator.weights.distributed import FLATTENED_BUCKET, BucketSender, DistributedUpdate, WeightSyncError

log = logging.getLogger(__name__)

__all__ = ["TRANSFER_MODES", "TrainWeights", "WeightSync", "WeightSyncError"]

#: --update-weight-transfer-mode → the transfer that runs (miles' names included: `config.sglang`'s table)
TRANSFER_MODES = TRANSFER_CARRIERS
DEFAULT_BUCKET_BYTES = 512 * 1024**2  # slime's --update-weight-buffer-size


#: the engine's load_format for a delta directory: `workers.shared_torch.weight_delta.LOAD_FORMAT` (not imported:
#: it imports torch, which the coordinator does not load for this)
DELTA_LOAD_FORMAT = "rayless_delta"
#: slime's --update-weight-mode: full (every tensor each sync) or delta (only the tensors whose bytes changed)
UPDATE_MODES = ("full", "delta")


class TrainWeights(BucketSender, Protocol):
    async def export_weights(self, directory: Path, weight_version: str, keep: int = 2) -> Path: ...

    async def export_weight_delta(self, directory: Path, weight_version: str, *, base_version: str,
                                  encoding: str, keep: int = 2) -> dict[str, Any]: ...


class WeightSync:
    """Weight updates of the rollout engines. `router`: the group's RouterHandle (`--use-sglang-router`), so
    that an engine this object's recovery brings back rejoins it."""

    def __init__(
        self,
        *,
        mode: str,
        fleet: EngineFleet,
        client: EngineClient,
        trainer: TrainWeights,
        snapshot_dir: Path,
        keep_snapshots: int = 2,
        recover_engines: bool = False,
        pause_mode: str = "in_place",
        host: str | Callable[[], str] = "127.0.0.1",
        backend: str = "gloo",
        router: RouterLike | None = None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        load_format: str | None = FLATTENED_BUCKET,
        join_timeout_s: float = 120.0,
        ack_timeout_s: float = 600.0,
        update_mode: str = "full",
        delta_encoding: str = "xor",
    ) -> None:
        if update_mode not in UPDATE_MODES:
            raise ValueError(f"--update-weight-mode {update_mode!r}: choose {', '.join(UPDATE_MODES)}")
        if update_mode == "delta" and TRANSFER_MODES.get(mode) != "disk":
            raise ValueError("--update-weight-mode delta moves the weights by disk: drop "
                             f"--update-weight-transfer-mode {mode}")
        if mode not in TRANSFER_MODES:
            raise ValueError(f"--update-weight-transfer-mode {mode!r}: choose {', '.join(TRANSFER_MODES)}")
        if bucket_bytes <= 0:
            raise ValueError(f"--update-weight-buffer-size must be > 0 bytes, got {bucket_bytes}")
        if not join_timeout_s > 0:
            raise ValueError(f"the weight-update group join timeout must be > 0 s, got {join_timeout_s}")
        if not ack_timeout_s > 0:
            raise ValueError(f"the weight-load acknowledgment timeout must be > 0 s, got {ack_timeout_s}")
        self.ack_timeout_s = ack_timeout_s
        self.mode = TRANSFER_MODES[mode]
        self.fleet = fleet
        self.client = client
        self.trainer = trainer
        self.snapshot_dir = Path(snapshot_dir)
        self.keep_snapshots = max(1, keep_snapshots)
        self.recover_engines = recover_engines
        self.pause_mode = pause_mode
        self.host = host
        self.backend = backend
        self.distributed = DistributedUpdate(
            client=client, trainer=trainer, host=host, backend=backend, bucket_bytes=bucket_bytes,
            load_format=load_format, join_timeout_s=join_timeout_s,
        )
        self.update_mode = update_mode
        self.delta_encoding = delta_encoding
        #: the version every engine holds after the last delta-mode update: the next delta's base (None: full)
        self._delta_base: str | None = None
        self.current_version: str | None = None
        self._snapshot: tuple[Path, str] | None = None  # the last export and the version it holds
        self._prepared: tuple[Path, str] | None = None  # exported ahead by prepare(), not yet pushed
        self._export_lock = anyio.Lock()
        self.recoveries = 0
        self.updating = anyio.Event()
        self.updating.set()  # set = not updating; the health monitor waits on it before probing
        self.recovery = EngineRecovery(fleet=fleet, weights=self, router=router)

    async def prepare(self, version: str) -> dict[str, float]:
        """Export the snapshot of `version` now, for the `update(version)` that follows (disk mode; a no-op for
        distributed). Colocation calls it before the ranks offload, so the update needs nothing from them."""
        if self.mode != "disk":
            return {}
        started = time.monotonic()
        async with self._export_lock:
            path = await self.trainer.export_weights(self.snapshot_dir, version, keep=self.keep_snapshots)
        self._prepared = (Path(path), version)
        return {"sync/export_s": time.monotonic() - started}

    def discard_prepared(self) -> None:
        """Forget a snapshot exported ahead (the ranks' state changed since: train FT restored a checkpoint)."""
        self._prepared = None

    async def update(self, version: str) -> dict[str, float]:
        started = time.monotonic()
        prepared = self._prepared
        if prepared is not None and prepared[1] == version and await anyio.Path(prepared[0]).exists():
            # The ranks already hold `version` and wrote it: it is the current policy an engine recovered now
            # must start from (and the snapshot the update below loads).
            async with self._export_lock:
                self._snapshot = prepared
                self.current_version = version
        self._prepared = None
        if self.recover_engines:
            await self._recover_dead_engines()
        engines = list(self.fleet.alive())
        metrics: dict[str, float] = {}
        if not engines:
            raise WeightSyncError("no rollout engine is alive to take the new weights")
        self.updating = anyio.Event()
        paused = engines
        try:
            engines = await self._for_each(engines, lambda e: self.client.engine(e.url).pause_generation(
                self.pause_mode), what="pause generation")
            try:
                if self.update_mode == "delta":
                    engines, metrics = await self._by_delta(engines, version)
                elif self.mode == "disk":
                    engines = await self._by_disk(engines, version)
                else:
                    await self._by_distributed(engines, version)
                engines = await self._verify(engines, version)
                if self.update_mode == "delta":
                    self._delta_base = version  # every engine holds it: the next delta's base
            finally:
                with anyio.CancelScope(shield=True), anyio.move_on_after(30):
                    await self._for_each(paused, lambda e: self.client.engine(e.url).continue_generation(),
                                         what="continue generation", raise_errors=False)
        finally:
            self.updating.set()
        self.current_version = version
        seconds = time.monotonic() - started
        return {"sync/time_s": seconds, "sync/engines": float(len(engines)), **metrics}

    async def _by_delta(self, engines: list[Any], version: str) -> tuple[list[Any], dict[str, float]]:
        """slime's delta update: rank 0 writes only the tensors changed since the version every engine holds
        (`_delta_base`), each engine applies them to its weights and checks their checksums; the first update,
        and any after one that failed, is a full snapshot. The base moves (in `update`) only once every engine
        reports the update's version; an engine recovery brought back was admitted at the current version, so
        the delta applies to it too. Returns the engines it succeeded on and the sync's metrics."""
        base, self._delta_base = self._delta_base, None
        async with self._export_lock:
            written = await self.trainer.export_weight_delta(
                self.snapshot_dir, version, base_version=base or "", encoding=self.delta_encoding,
                keep=self.keep_snapshots)
            if not written.delta:
                self._snapshot = (Path(written.path), version)
        load_format = DELTA_LOAD_FORMAT if written.delta else None
        engines = await self._for_each(
            engines,
            lambda e: self._load(self.client.engine(e.url), written.path, version, load_format=load_format,
                                 flush_cache=True),
            what="update_weights_from_disk (delta)" if written.delta else "update_weights_from_disk",
        )
        return engines, {"sync/delta": float(written.delta), "sync/changed_tensors": float(len(written.changed))}

    async def _load(self, api: Any, path: str, version: str, **kw: Any) -> None:
        """One engine's load of the snapshot at `path`, acknowledged within `ack_timeout_s`."""
        with acknowledged(api.url, "POST /update_weights_from_disk", bound=self.ack_timeout_s,
                          flag="--update-weight-ack-timeout"):
            await api.update_weights_from_disk(path, weight_version=version, timeout=read_timeout(self.ack_timeout_s),
                                               **kw)

    async def _by_disk(self, engines: list[Any], version: str) -> list[Any]:
        async with self._export_lock:
            snapshot = self._snapshot
            if snapshot is not None and snapshot[1] == version and await anyio.Path(snapshot[0]).exists():
                path = snapshot[0]  # exported ahead (`prepare`)
            else:
                path, _ = await self._export(version)
        return await self._for_each(
            engines, lambda e: self._load(self.client.engine(e.url), str(path), version, flush_cache=True),
            what="update_weights_from_disk")

    async def _by_distributed(self, engines: list[Any], version: str) -> None:
        # A fresh group per update: an engine relaunched since the last update can always join.
        await self.distributed.run(engines, version)

    async def _verify(self, engines: list[Any], version: str) -> list[Any]:
        async def ask(engine: Any) -> None:
            got = await self.client.engine(engine.url).get_weight_version()
            if got != version:
                raise EngineError(f"reports weight version {got!r} after the update to {version!r}", engine.url)

        return await self._for_each(engines, ask, what="get_weight_version")

    # -- the current weights, for an engine that comes back ----------------------------------------------

    async def _export(self, version: str) -> tuple[Path, str]:
        """Rank 0 writes <snapshot_dir>/weights-<version> atomically and prunes all but the last `keep`."""
        path = await self.trainer.export_weights(self.snapshot_dir, version, keep=self.keep_snapshots)
        self._snapshot = (Path(path), version)
        return self._snapshot

    async def current_weights(self) -> tuple[Path, str] | None:
        """(snapshot directory, version) of the current weights, exported now when no snapshot of this version
        is on disk (the distributed mode keeps none; old ones are pruned). None before the first update: the
        engines start from --hf-checkpoint, which is the current policy then."""
        version = self.current_version
        if version is None:
            return None
        async with self._export_lock:  # two engines recovering at once export once
            snapshot = self._snapshot
            if snapshot is not None and snapshot[1] == version and await anyio.Path(snapshot[0]).exists():
                return snapshot
            return await self._export(version)

    async def admit(self, engine: EngineHandle) -> None:
        """Make a (re)started engine that is not in dispatch yet serve the current weights.

        Returns at a moment when the engine reports the current version and no update runs (the fleet marks
        it ALIVE right after, with no await in between, so it cannot miss an update); raises WeightSyncError
        when it does not take the current weights.
        """
        api = self.client.engine(engine.url)
        while True:
            while not self.updating.is_set():  # an update runs: admit against the version it leaves
                await self.updating.wait()
            version = self.current_version
            if version is None:
                return  # engines start from --hf-checkpoint, which is the current policy
            if await api.get_weight_version() != version:
                current = await self.current_weights()
                if current is None or current[1] != version:
                    continue  # an update finished meanwhile: load the newer weights instead
                await self._load(api, str(current[0]), version)
                got = await api.get_weight_version()
                if got != version:
                    raise WeightSyncError(f"{engine.name} reports weight version {got!r} after recovery, "
                                          f"expected {version!r}")
            if self.updating.is_set() and self.current_version == version:
                return

    async def _recover_dead_engines(self) -> None:
        dead = [engine for engine in self.fleet.engines if not engine.alive]
        for engine in dead:
            log.warning("recovering dead rollout engine %s before the weight update", engine.name)
            if await self.recovery.recover(engine):
                self.recoveries += 1

    async def _for_each(self, engines: list[Any], fn: Any, *, what: str, raise_errors: bool = True) -> list[Any]:
        """`fn(engine)` on every engine at once; the engines it succeeded on. Failures raise one
        `WeightSyncError` naming each engine — unless rollout FT recovers engines and some succeeded: then the
        failed ones are marked dead (their recovery loads the current weights) and the update goes on."""
        errors: dict[str, str] = {}

        async def one(engine: Any) -> None:
            try:
                with span(what, ("weight sync", engine.name)):  # pause, transfer, verify, resume: per engine
                    await fn(engine)
            except EngineError as error:
                errors[engine.name] = str(error)

        async with anyio.create_task_group() as group:
            for engine in engines:
                group.start_soon(one, engine)
        if not errors:
            return engines
        if not raise_errors:
            log.warning("%s failed on %s", what, errors)
            return engines
        survivors = [engine for engine in engines if engine.name not in errors]
        if not (self.recover_engines and survivors):
            raise WeightSyncError(f"{what} failed on {len(errors)} engine(s): {errors}")
        for engine in engines:
            if engine.name in errors:
                log.warning("rollout engine %s failed the weight update (%s: %s): marked dead, it is recovered "
                            "with the current weights; the update goes on with %d engine(s)", engine.name, what,
                            errors[engine.name], len(survivors))
                self.fleet.mark_dead(engine, f"{what} failed during a weight update: {errors[engine.name]}")
        return survivors
