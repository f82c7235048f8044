"""Distributed weight updates that fail: bounded in time, reported as one line naming the engines.

Real CPU engines and a real torchrun rank, started once for the module (`failed_updates` runs every scenario on
them and records what each update did; the tests read the records). An engine that never joins is SIGSTOPped
(hung: its socket stays open, nothing answers): the update must end within about the join timeout with one
WeightSyncError line that names the engine and the timeout (not an exception group, not a two-minute wait), and
the training group must stay usable: once the engine runs again, the next update goes through. An engine
serving another model receives every bucket and refuses to load it: the others still get the whole update, at
once, not after the transfer timeout.

The same rank and two of the engines then take slime's delta updates (`--update-weight-mode delta`) between
training steps: only the tensors whose bytes changed are written, and the engines end up with the weights a full
update gives, bit for bit; a damaged delta is refused and leaves the engine's weights as they were.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from collections.abc import Awaitable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
import torch

from coordinator.engines.client import EngineClient
from coordinator.engines.errors import EngineError
from coordinator.engines.fleet import EngineFleet
from coordinator.train.group import TrainGroup
from coordinator.train.torchrun import TorchrunSpec
from coordinator.weights.distributed import REPORT_GRACE_S, WeightSyncError
from coordinator.weights.sync import WeightSync
from tests.support.engine_proc import start_engine_process
from tests.support.train_samples import TRAIN_CONFIG, as_samples, synthetic_samples
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
    delta: DeltaUpdates = field(default_factory=lambda: DeltaUpdates())


@dataclass
class DeltaUpdates:
    """What the delta-mode updates did: per update its metrics and the names written; the weights involved."""

    metrics: dict[str, dict[str, float]] = field(default_factory=dict)
    written: dict[str, list[str]] = field(default_factory=dict)
    #: names whose bytes differ between full snapshots of d1 and d2, by the test's own comparison
    differing_d1_d2: list[str] = field(default_factory=list)
    full: dict[str, list[Any]] = field(default_factory=dict)  # the full snapshot of the last version, as lists
    by_delta: dict[str, list[Any]] = field(default_factory=dict)  # what the engine that took deltas serves
    by_full: dict[str, list[Any]] = field(default_factory=dict)  # ... the engine that then took a full update
    damaged: Attempt = field(default_factory=Attempt)
    after_damaged: dict[str, list[Any]] = field(default_factory=dict)
    version_after_damaged: str = ""


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
        sync = WeightSync(mode="distributed", fleet=fleet, client=client, trainer=group.commands,
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
        sync = WeightSync(mode="distributed", fleet=fleet, client=client, trainer=group.commands,
                          snapshot_dir=run_dir / "snapshots", bucket_bytes=24 * 1024,
                          join_timeout_s=REFUSAL_JOIN_TIMEOUT_S)
        record.refused_load = await attempt(sync.distributed.run(fleet.alive(), "4"))
        record.versions_after_refusal = await versions(client, urls)
        tg.cancel_scope.cancel()


def file_tensors(directory: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    return load_file(str(directory / "model.safetensors"))


async def served_weights(url: str, names: list[str]) -> dict[str, list[Any]]:
    """Every named parameter as the engine holds it (SGLang's /get_weights_by_name, untruncated)."""
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        served = {}
        for name in names:
            response = await http.post("/get_weights_by_name", json={"name": name, "truncate_size": 1 << 20})
            assert response.status_code == 200, response.text
            served[name] = response.json()
        return served


async def delta_updates(record: FailedUpdates, client: EngineClient, group: TrainGroup, run_dir: Path,
                        model_dir: Path) -> None:
    """first + second, --update-weight-mode delta: d1 (full: no base yet), train, d2 (delta), d3 (nothing
    trained: an empty delta), train, d4 (delta, overwrite encoding); then second takes d4 as a full update, and
    first is handed a damaged delta."""
    out = record.delta
    urls = [record.urls["first"], record.urls["second"]]
    samples = as_samples(synthetic_samples(model_dir, 4, seed=3))
    async with anyio.create_task_group() as tg:
        fleet = EngineFleet(client=client, external_urls=urls, run_dir=run_dir)
        await tg.start(fleet.run)
        sync = WeightSync(mode="disk", update_mode="delta", fleet=fleet, client=client, trainer=group.commands,
                          snapshot_dir=run_dir / "snapshots", keep_snapshots=8)

        async def update(version: str) -> None:
            out.metrics[version] = await sync.update(version)
            delta = run_dir / "snapshots" / f"delta-{version}" / "delta.json"
            out.written[version] = sorted(json.loads(delta.read_text())["tensors"]) if delta.exists() else []

        await update("d1")
        await group.commands.train(10, samples)  # warm-up's first step has learning rate 0: the second changes weights
        await group.commands.train(11, samples)
        await update("d2")
        full_d1 = file_tensors(run_dir / "snapshots" / "weights-d1")
        full_d2 = file_tensors(await group.commands.export_weights(run_dir / "full", "d2", keep=8))
        out.differing_d1_d2 = sorted(name for name in full_d2 if not torch.equal(
            full_d1[name].view(-1).view(torch.uint8), full_d2[name].view(-1).view(torch.uint8)))
        await update("d3")
        await group.commands.train(12, samples)
        sync.delta_encoding = "overwrite"
        await update("d4")
        full_d4 = await group.commands.export_weights(run_dir / "full", "d4", keep=8)
        names = sorted(file_tensors(full_d4))
        out.full = {name: tensor.tolist() for name, tensor in file_tensors(full_d4).items()}
        out.by_delta = await served_weights(urls[0], names)
        await client.engine(urls[1]).update_weights_from_disk(str(full_d4), weight_version="d4")
        out.by_full = await served_weights(urls[1], names)

        await group.commands.train(13, samples)
        written = await group.commands.export_weight_delta(run_dir / "snapshots", "d5", base_version="d4", encoding="xor")
        payload = Path(written.path) / "delta.safetensors"
        damaged = bytearray(payload.read_bytes())
        damaged[-3] ^= 0x40
        payload.write_bytes(bytes(damaged))
        out.damaged = await attempt(client.engine(urls[0]).update_weights_from_disk(
            written.path, load_format="rayless_delta", weight_version="d5"))
        out.after_damaged = await served_weights(urls[0], names)
        out.version_after_damaged = await client.engine(urls[0]).get_weight_version()
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
        with anyio.fail_after(360):
            async with EngineClient(max_connections=8) as client, anyio.create_task_group() as tg:
                group: TrainGroup = await tg.start(TrainGroup(TorchrunSpec(nproc_per_node=1), run_dir=root / "run").run)
                await group.commands.init(flat_settings({**TRAIN_CONFIG, "model_path": str(tiny_model_dir)}))
                await never_joining(record, client, group, second.process.pid, root / "hung")
                await refusing_to_load(record, client, group, root / "refused")
                await delta_updates(record, client, group, root / "delta", tiny_model_dir)
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


async def test_delta_updates_write_only_changed_tensors_and_leave_the_weights_of_a_full_update(
    failed_updates: FailedUpdates,
) -> None:
    delta = failed_updates.delta
    assert delta.metrics["d1"]["sync/delta"] == 0.0  # no base yet: a full snapshot
    assert delta.metrics["d2"]["sync/delta"] == 1.0
    # d2 holds exactly the tensors whose bytes a training step changed, by the test's own comparison
    assert delta.differing_d1_d2 and delta.written["d2"] == delta.differing_d1_d2
    assert delta.metrics["d2"]["sync/changed_tensors"] == len(delta.differing_d1_d2)
    assert delta.metrics["d3"]["sync/delta"] == 1.0 and delta.written["d3"] == []  # nothing trained: nothing written
    assert delta.metrics["d4"]["sync/delta"] == 1.0 and delta.written["d4"]
    # after the deltas, the engine holds bit for bit what a full update of d4 gives
    assert delta.by_delta == delta.full
    assert delta.by_full == delta.by_delta


async def test_a_damaged_delta_is_refused_and_the_engine_keeps_its_weights(failed_updates: FailedUpdates) -> None:
    delta = failed_updates.delta
    assert isinstance(delta.damaged.error, EngineError), delta.damaged.error
    assert "refusing the delta" in str(delta.damaged.error)
    assert delta.after_damaged == delta.by_delta
    assert delta.version_after_damaged == "d4"
