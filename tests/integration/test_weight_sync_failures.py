"""Distributed weight updates that fail: bounded in time, reported as one line naming the engines.

Real CPU engines and a real torchrun rank, started once for the module (`failed_updates` runs every scenario on
them and records what each update did; the tests read the records). An engine that never joins is SIGSTOPped
(hung: its socket stays open, nothing answers): the update must end within about the join timeout with one
WeightSyncError line that names the engine and the timeout (not an exception group, not a two-minute wait), and
the training group must stay usable: once the engine runs again, the next update goes through. An engine
serving another model receives every bucket and refuses to load it: the others still get the whole update, at
once, not after the transfer timeout.
"""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Awaitable
from dataclasses import dataclass, field
from pathlib import Path

import anyio
import pytest

from coordinator.engines.client import EngineClient
from coordinator.engines.fleet import EngineFleet
from coordinator.train.group import TrainGroup
from coordinator.weights.distributed import REPORT_GRACE_S, WeightSyncError
from coordinator.weights.sync import WeightSync
from tests.support.engine_proc import start_engine_process
from tests.support.train_samples import TRAIN_CONFIG
from tests.support.train_settings import flat_settings
from workers.tiny_model import TinyModelSpec, build_tiny_model

JOIN_TIMEOUT_S = 3.0
#: the join timeout of the refused update: what it must not wait out (a send waiting for a missing receiver)
REFUSAL_JOIN_TIMEOUT_S = 60.0


@dataclass
class Attempt:
    """One update that was expected to fail: what it raised and how long it took."""

    error: BaseException | None = None
    elapsed_s: float = 0.0


@dataclass
class FailedUpdates:
    urls: dict[str, str] = field(default_factory=dict)  # "first", "second", "wrong"
    formed: Attempt = field(default_factory=Attempt)  # the first update, which goes through: the calibration
    hung: Attempt = field(default_factory=Attempt)
    nccl: Attempt = field(default_factory=Attempt)
    versions_after_recovery: dict[str, str] = field(default_factory=dict)
    refused_load: Attempt = field(default_factory=Attempt)
    versions_after_refusal: dict[str, str] = field(default_factory=dict)


async def attempt(update: Awaitable[object]) -> Attempt:
    started = time.monotonic()
    try:
        await update
    except Exception as error:  # recorded: each test asserts the type and message it expects
        return Attempt(error, time.monotonic() - started)
    return Attempt(None, time.monotonic() - started)


async def versions(client: EngineClient, urls: list[str]) -> dict[str, str]:
    return {url: await client.engine(url).get_weight_version() for url in urls}


async def never_joining(record: FailedUpdates, client: EngineClient, group: TrainGroup, second_pid: int,
                        run_dir: Path) -> None:
    """first + second; second hangs (SIGSTOP) for one update; then an update over NCCL; then a good one."""
    urls = [record.urls["first"], record.urls["second"]]
    async with anyio.create_task_group() as tg:
        fleet = EngineFleet(client=client, external_urls=urls, run_dir=run_dir)
        await tg.start(fleet.run)
        sync = WeightSync(mode="distributed", fleet=fleet, client=client, trainer=group,
                          snapshot_dir=run_dir / "snapshots", join_timeout_s=JOIN_TIMEOUT_S)
        engines = fleet.alive()
        # the group forms; the external engines' tp sizes are known from here
        record.formed = await attempt(sync.update("1"))
        assert record.formed.error is None, record.formed.error
        os.killpg(second_pid, signal.SIGSTOP)
        try:
            record.hung = await attempt(sync.distributed.run(engines, "2"))
        finally:
            os.killpg(second_pid, signal.SIGCONT)
        # Engines that answer at once but cannot join (NCCL on a CPU engine): named with their reason.
        sync.distributed.backend = "nccl"
        record.nccl = await attempt(sync.distributed.run(engines, "2"))
        sync.distributed.backend = "gloo"
        await sync.update("3")  # the training group and both engines are still usable
        record.versions_after_recovery = await versions(client, urls)
        tg.cancel_scope.cancel()


async def refusing_to_load(record: FailedUpdates, client: EngineClient, group: TrainGroup, run_dir: Path) -> None:
    """first (the trained model) + wrong (another model), small buckets, a long join timeout."""
    urls = [record.urls["first"], record.urls["wrong"]]
    async with anyio.create_task_group() as tg:
        fleet = EngineFleet(client=client, external_urls=urls, run_dir=run_dir)
        await tg.start(fleet.run)
        sync = WeightSync(mode="distributed", fleet=fleet, client=client, trainer=group,
                          snapshot_dir=run_dir / "snapshots", bucket_bytes=24 * 1024,
                          join_timeout_s=REFUSAL_JOIN_TIMEOUT_S)
        record.refused_load = await attempt(sync.distributed.run(fleet.alive(), "4"))
        record.versions_after_refusal = await versions(client, urls)
        tg.cancel_scope.cancel()


@pytest.fixture(scope="module")
async def failed_updates(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> FailedUpdates:
    root = tmp_path_factory.mktemp("sync-failures")
    other_model = build_tiny_model(root / "narrow", TinyModelSpec(hidden_size=32, num_attention_heads=2,
                                                                  num_key_value_heads=1))
    record = FailedUpdates()
    with start_engine_process(tiny_model_dir, log_path=root / "e0.log") as first, \
            start_engine_process(tiny_model_dir, log_path=root / "e1.log") as second, \
            start_engine_process(other_model, log_path=root / "e2.log") as wrong:
        record.urls = {"first": first.url, "second": second.url, "wrong": wrong.url}
        with anyio.fail_after(240):
            async with EngineClient(max_connections=8) as client, anyio.create_task_group() as tg:
                group: TrainGroup = await tg.start(TrainGroup(nproc_per_node=1, run_dir=root / "run").run)
                await group.init(flat_settings({**TRAIN_CONFIG, "model_path": str(tiny_model_dir)}))
                await never_joining(record, client, group, second.process.pid, root / "hung")
                await refusing_to_load(record, client, group, root / "refused")
                await group.shutdown()
                tg.cancel_scope.cancel()
    return record


async def test_engines_that_never_join_fail_the_update_in_one_line_within_the_join_timeout(
    failed_updates: FailedUpdates,
) -> None:
    hung = failed_updates.hung
    assert isinstance(hung.error, WeightSyncError), hung.error
    message = str(hung.error)
    assert "\n" not in message, message
    assert f"did not form within {JOIN_TIMEOUT_S:g} s" in message, message
    second = failed_updates.urls["second"]
    assert f"never answered /init_weights_update_group: rollout-ext-1 ({second})" in message
    # The join timeout and the engines' grace after it are waited for by design; the rest (rank 0's report, the
    # cleanup's requests) is a round of the requests a whole update makes, timed on the same engines and rank at
    # the same load (`formed`), with margin; never under the quiet machine's 12 s. Not minutes, on any machine.
    bound = max(JOIN_TIMEOUT_S + 12, JOIN_TIMEOUT_S + REPORT_GRACE_S + 3 * failed_updates.formed.elapsed_s)
    assert hung.elapsed_s < bound, (hung.elapsed_s, failed_updates.formed.elapsed_s)

    nccl = failed_updates.nccl
    assert isinstance(nccl.error, WeightSyncError), nccl.error
    assert re.search(r"rollout-ext-0 \(.*\): /init_weights_update_group failed: .*backend 'nccl' needs CUDA",
                     str(nccl.error)), nccl.error

    # the training group and both engines were still usable: the next update reached both
    assert failed_updates.versions_after_recovery == {failed_updates.urls["first"]: "3", second: "3"}


async def test_an_engine_that_cannot_load_the_weights_fails_alone_and_at_once(failed_updates: FailedUpdates) -> None:
    refused = failed_updates.refused_load
    assert isinstance(refused.error, WeightSyncError), refused.error
    assert refused.elapsed_s < REFUSAL_JOIN_TIMEOUT_S  # not the wait a send makes for a missing receiver
    message = str(refused.error)
    assert "\n" not in message
    wrong, good = failed_updates.urls["wrong"], failed_updates.urls["first"]
    assert f"rollout-ext-1 ({wrong}): /update_weights_from_distributed (bucket 1 of" in message
    assert "shape" in message and "rollout-ext-0" not in message, message
    assert failed_updates.versions_after_refusal[good] == "4"
    assert failed_updates.versions_after_refusal[wrong] != "4"
