"""One distributed weight update: the group's layout, rank 0's sends and each engine's requests, and the report
of what went wrong.

Owns the layout of a weight-update group (world size and rank offsets counted in tensor-parallel ranks), the
request sequence per engine (`/init_weights_update_group`, `/begin_weight_update`, one
`/update_weights_from_distributed` per bucket, `/end_weight_update`), running it beside the trainer's
`broadcast_weights`, and turning every failure into one `WeightSyncError` line.

Invariants:
- world_size = 1 + the sum of every engine's tp size; engine i's rank_offset = 1 + the tp sizes of the engines
  before it (SGLang adds each tp rank to its offset);
- every engine is asked for exactly the buckets rank 0 sends, in order; `weight_version` and the cache flush go
  with the last bucket only, so an engine that took part of an update never reports the new version;
- the group's join is bounded by `join_timeout_s` (so is every transfer over it): engines that never join end
  the update within about that time with a WeightSyncError naming them, never an exception group;
- a session this opened is closed, and the group destroyed on rank 0 and on every engine that joined, on every
  exit path (shielded, bounded).
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import anyio

from coordinator.engines.client import EngineClient
from coordinator.engines.errors import EngineError, EngineHTTPError, EngineTimeout
from coordinator.engines.policy import NO_RETRY
from coordinator.engines.spec import free_port
from workers import protocol
from workers.errors import RaylessError

log = logging.getLogger(__name__)

FLATTENED_BUCKET = "flattened_bucket"
CLEANUP_TIMEOUT_S = 30.0
# After rank 0 gave up, how long engines still get to answer: one that joined fails at once when rank 0's
# store goes away, so what is still unanswered then is an engine that never joined.
REPORT_GRACE_S = 5.0


class WeightSyncError(RaylessError, RuntimeError):
    """Engines did not take the new weights."""


class BucketSender(Protocol):
    async def weight_buckets(self, bucket_bytes: int) -> list[list[tuple[str, str, list[int]]]]: ...

    async def broadcast_weights(self, master_address: str, master_port: int, world_size: int, group_name: str,
                                timeout_s: float, *, backend: str, bucket_bytes: int,
                                load_format: str | None) -> protocol.BroadcastWeightsReply: ...

    async def destroy_weight_group(self, group_name: str) -> bool: ...


@dataclass(frozen=True)
class GroupLayout:
    world_size: int
    rank_offsets: list[int]


def group_layout(tp_sizes: Sequence[int]) -> GroupLayout:
    """Rank 0 is the trainer; each engine takes as many consecutive ranks as it has tp ranks."""
    offsets, next_rank = [], 1
    for tp_size in tp_sizes:
        if tp_size < 1:
            raise ValueError(f"an engine's tp size must be >= 1, got {tp_size}")
        offsets.append(next_rank)
        next_rank += tp_size
    return GroupLayout(world_size=next_rank, rank_offsets=offsets)


@dataclass
class _Engine:
    """One engine's part of the update, as seen from here."""

    handle: Any
    rank_offset: int
    stage: str = "not started"  # the request it is in, or the last one it finished
    joined: bool = False
    session: bool = False
    buckets: int = 0
    error: str | None = None

    @property
    def label(self) -> str:
        return f"{self.handle.name} ({self.handle.url})"


class DistributedUpdate:
    """Moves the trainer's weights into `engines` over one fresh weight-update group."""

    def __init__(
        self,
        *,
        client: EngineClient,
        trainer: BucketSender,
        host: str | Callable[[], str],
        backend: str,
        bucket_bytes: int,
        load_format: str | None,
        join_timeout_s: float,
        request_timeout_s: float = 600.0,
    ) -> None:
        self.client = client
        self.trainer = trainer
        self.host = host
        self.backend = backend
        self.bucket_bytes = bucket_bytes
        self.load_format = load_format
        self.join_timeout_s = join_timeout_s
        self.request_timeout_s = request_timeout_s
        self._asked_tp: dict[tuple[str, int], int] = {}  # (engine, incarnation) → what its /server_info said

    async def tp_sizes(self, engines: Sequence[Any]) -> list[int]:
        """Each engine's tp size: the fleet's for launched engines, `/server_info`'s for external ones (asked
        once per incarnation, within the join timeout)."""
        sizes = []
        for engine in engines:
            size = getattr(engine, "tp_size", None)
            key = (engine.name, getattr(engine, "incarnation", 0))
            if size is None:
                size = self._asked_tp.get(key)
            if size is None:
                try:
                    info = await self.client.engine(engine.url).server_info(timeout=self.join_timeout_s,
                                                                             retry=NO_RETRY)
                except EngineError as exc:
                    raise WeightSyncError(f"cannot read the tp size of {engine.name}: {exc}") from None
                size = info.get("tp_size", 1)
            if not isinstance(size, int) or isinstance(size, bool) or size < 1:
                raise WeightSyncError(f"{engine.name} reports tp_size {size!r}; expected an integer >= 1")
            self._asked_tp[key] = size
            sizes.append(size)
        return sizes

    def master_host(self) -> str:
        """The group's store address: where rank 0 runs (`host`, or asked of `host()` per update: on several
        nodes rank 0 is wherever torchrun's rendezvous put it)."""
        return self.host() if callable(self.host) else self.host

    async def run(self, engines: Sequence[Any], version: str) -> None:
        layout = group_layout(await self.tp_sizes(engines))
        buckets = await self.trainer.weight_buckets(self.bucket_bytes)
        host = self.master_host()
        try:
            port = free_port(host)
        except OSError:  # rank 0 is on another node: a port free here is the best guess for there
            port = free_port("0.0.0.0")
        group_name = f"rayless_weights_{version}_{secrets.token_hex(3)}"
        sides = [_Engine(handle=e, rank_offset=offset) for e, offset in zip(engines, layout.rank_offsets, strict=True)]
        where = f"{group_name!r} (world size {layout.world_size}, store {host}:{port}, {self.backend})"
        report = protocol.BroadcastWeightsReply()  # rank 0's, once it answered: until then, nothing sent
        trainer_failure: BaseException | None = None
        engines_scope = anyio.CancelScope()

        async def trainer_side() -> None:
            nonlocal trainer_failure, report
            try:
                report = (await self.trainer.broadcast_weights(
                    host, port, layout.world_size, group_name, self.join_timeout_s, backend=self.backend,
                    bucket_bytes=self.bucket_bytes, load_format=self.load_format))
            except Exception as exc:  # RankFailure / RankCommandError: re-raised below, outside the task group
                trainer_failure = exc
            if trainer_failure is not None or not report.ok:
                grace = REPORT_GRACE_S  # nobody sends any more: what still waits, waits for nothing
            else:
                grace = max(self.join_timeout_s, CLEANUP_TIMEOUT_S)  # they only have the last bucket to load
            engines_scope.deadline = min(engines_scope.deadline, anyio.current_time() + grace)

        async def engines_side() -> None:
            with engines_scope:
                await self._store_listening(host, port)
                async with anyio.create_task_group() as group:
                    for side in sides:
                        group.start_soon(self._engine, side, layout.world_size, host, port, group_name, buckets,
                                         version)

        try:
            async with anyio.create_task_group() as group:
                group.start_soon(trainer_side)
                group.start_soon(engines_side)
        finally:
            with anyio.CancelScope(shield=True), anyio.move_on_after(CLEANUP_TIMEOUT_S):
                await self._cleanup(sides, group_name)
        if trainer_failure is not None:
            raise trainer_failure
        failed = [side for side in sides if side.error is not None or side.buckets < len(buckets)]
        if report.ok and not failed:
            return
        raise WeightSyncError(self._explain(version, where, report, sides, len(buckets)))

    async def _store_listening(self, host: str, port: int) -> None:
        """Wait (within the join timeout) until rank 0's store accepts connections. An engine that dials it
        earlier is refused and backs off for 0.3-5 s before it tries again (measured with torch 2.13): asking
        the engines only now keeps that out of every update."""
        with anyio.move_on_after(self.join_timeout_s):
            while True:
                try:
                    with anyio.fail_after(1.0):
                        stream = await anyio.connect_tcp(host, port)
                    await stream.aclose()
                    return
                except (OSError, TimeoutError):
                    await anyio.sleep(0.005)

    async def _engine(self, side: _Engine, world_size: int, host: str, port: int, group_name: str,
                      buckets: list[list[tuple[str, str, list[int]]]], version: str) -> None:
        api = self.client.engine(side.handle.url)
        try:
            side.stage = "/init_weights_update_group"
            # Answered once every rank joined: rank 0 waits join_timeout_s, so that long and a margin.
            await api.init_weights_update_group(
                master_address=host, master_port=port, rank_offset=side.rank_offset, world_size=world_size,
                group_name=group_name, backend=self.backend, timeout=self.join_timeout_s + 10.0)
            side.joined = True
            side.stage = "/begin_weight_update"
            side.session = await self._begin(api, side)
            for index, bucket in enumerate(buckets):
                last = index == len(buckets) - 1
                stage = f"/update_weights_from_distributed (bucket {index + 1} of {len(buckets)})"
                side.stage = stage if side.error is None else side.stage
                try:
                    await api.update_weights_from_distributed(
                        names=[name for name, _, _ in bucket], dtypes=[dtype for _, dtype, _ in bucket],
                        shapes=[shape for _, _, shape in bucket], group_name=group_name,
                        load_format=self.load_format, flush_cache=last,
                        weight_version=version if last and side.error is None else None,
                        timeout=self.request_timeout_s)
                except EngineHTTPError as exc:
                    # The engine answered: it received the bucket, then failed to load it. Keep it receiving
                    # the rest, so rank 0 and the other engines finish instead of waiting out the timeout.
                    side.error = side.error or f"{stage} failed: {exc}"
                    continue
                side.buckets += 1
            if side.error is None:
                side.stage = "done"
        except EngineTimeout as exc:
            side.error = side.error or f"no answer to {side.stage} within {exc.timeout:g} s"
        except EngineError as exc:
            side.error = side.error or f"{side.stage} failed: {exc}"

    async def _begin(self, api: Any, side: _Engine) -> bool:
        """Open the session SGLang 0.5.21+ requires (False: an older server without one). A session left open
        by an update that never ended (a coordinator that died) is closed first: this process is the only one
        that updates these engines."""
        try:
            return await api.begin_weight_update()
        except EngineError as exc:
            if "already open" not in str(exc):
                raise
            log.warning("%s had a weight-update session open from an earlier update; closing it", side.label)
            await api.end_weight_update()
            return await api.begin_weight_update()

    async def _cleanup(self, sides: list[_Engine], group_name: str) -> None:
        async def end_and_destroy(side: _Engine) -> None:
            api = self.client.engine(side.handle.url)
            try:
                if side.session:
                    await api.end_weight_update(timeout=CLEANUP_TIMEOUT_S)
                if side.joined:
                    await api.destroy_weights_update_group(group_name, timeout=CLEANUP_TIMEOUT_S)
            except EngineError as exc:
                log.warning("cleaning up weight-update group %s on %s: %s", group_name, side.label, exc)

        async with anyio.create_task_group() as group:
            for side in sides:
                group.start_soon(end_and_destroy, side)
            try:
                await self.trainer.destroy_weight_group(group_name)
            except Exception as exc:  # the trainer's own failure is reported by run()
                log.warning("rank 0 could not destroy weight-update group %s: %s", group_name, exc)

    def _explain(self, version: str, where: str, report: protocol.BroadcastWeightsReply, sides: list[_Engine],
                 total: int) -> str:
        """One line: what failed, where, and what to look at."""
        error = report.error
        if not report.joined:
            asked = [side for side in sides if side.stage == "/init_weights_update_group"]
            silent = [side for side in asked if side.error is None or side.error.startswith("no answer")]
            failed = [f"{side.label}: {side.error}" for side in asked if side not in silent]
            parts = [f"weight update to version {version!r}: the weight-update group {where} did not form within "
                     f"{self.join_timeout_s:g} s"]
            if silent:
                parts.append(f"never answered /init_weights_update_group: {', '.join(s.label for s in silent)}")
            if failed:
                parts.append("; ".join(failed))
            if error:
                parts.append(f"rank 0: {error.rpartition(' s: ')[2] or error}")
            parts.append("check that every engine can reach the store address and port (--update-weight-join-"
                         "timeout bounds this wait)")
            return "; ".join(parts)
        parts = [f"weight update to version {version!r} over {where} failed"]
        if error:
            parts.append(f"rank 0: {error}")
        parts += [f"{side.label}: {side.error or f'took {side.buckets} of {total} buckets'}" for side in sides
                  if side.error is not None or side.buckets < total]
        return "; ".join(parts)
