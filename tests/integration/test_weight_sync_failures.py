"""Distributed weight updates that fail: bounded in time, reported as one line naming the engines.

Real CPU engines and a real torchrun rank. An engine that never joins is SIGSTOPped (hung: its socket stays
open, nothing answers): the update must end within about the join timeout with one WeightSyncError line that
names the engine and the timeout (not an exception group, not a two-minute wait), and the training group must
stay usable: once the engine runs again, the next update goes through. An engine serving another model
receives every bucket and refuses to load it: the others still get the whole update, at once, not after the
transfer timeout.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import anyio
import pytest

from coordinator.engines.client import EngineClient
from coordinator.engines.fleet import EngineFleet
from coordinator.train.group import TrainGroup
from coordinator.weights.distributed import WeightSyncError
from coordinator.weights.sync import WeightSync
from tests.support.engine_proc import start_engine_process
from tests.support.train_samples import TRAIN_CONFIG
from tests.support.train_settings import flat_settings
from workers.tiny_model import TinyModelSpec, build_tiny_model

JOIN_TIMEOUT_S = 3.0


async def test_engines_that_never_join_fail_the_update_in_one_line_within_the_join_timeout(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    with start_engine_process(tiny_model_dir, log_path=tmp_path / "e0.log") as first, \
            start_engine_process(tiny_model_dir, log_path=tmp_path / "e1.log") as second:
        with anyio.fail_after(240):
            async with EngineClient(max_connections=8) as client, anyio.create_task_group() as tg:
                group: TrainGroup = await tg.start(TrainGroup(nproc_per_node=1, run_dir=tmp_path / "run").run)
                await group.init(flat_settings({**TRAIN_CONFIG, "model_path": str(tiny_model_dir)}))
                fleet = EngineFleet(client=client, external_urls=[first.url, second.url], run_dir=tmp_path)
                await tg.start(fleet.run)
                sync = WeightSync(mode="distributed", fleet=fleet, client=client, trainer=group,
                                  snapshot_dir=tmp_path / "snapshots", join_timeout_s=JOIN_TIMEOUT_S)
                engines = fleet.alive()
                await sync.update("1")  # the group forms; the external engines' tp sizes are known from here

                os.killpg(second.process.pid, signal.SIGSTOP)
                try:
                    started = time.monotonic()
                    with pytest.raises(WeightSyncError) as failure:
                        await sync.distributed.run(engines, "2")
                    elapsed = time.monotonic() - started
                finally:
                    os.killpg(second.process.pid, signal.SIGCONT)
                message = str(failure.value)
                assert "\n" not in message, message
                assert f"did not form within {JOIN_TIMEOUT_S:g} s" in message, message
                assert f"never answered /init_weights_update_group: rollout-ext-1 ({second.url})" in message
                assert elapsed < JOIN_TIMEOUT_S + 12, elapsed  # join timeout + the engines' grace + cleanup

                # Engines that answer at once but cannot join (NCCL on a CPU engine): named with their reason.
                sync.distributed.backend = "nccl"
                with pytest.raises(WeightSyncError, match=r"rollout-ext-0 \(.*\): /init_weights_update_group "
                                                          r"failed: .*backend 'nccl' needs CUDA"):
                    await sync.distributed.run(engines, "2")
                sync.distributed.backend = "gloo"

                await sync.update("3")  # the training group and both engines are still usable
                for url in (first.url, second.url):
                    assert await client.engine(url).get_weight_version() == "3"
                await group.shutdown()
                tg.cancel_scope.cancel()


async def test_an_engine_that_cannot_load_the_weights_fails_alone_and_at_once(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    other_model = build_tiny_model(tmp_path / "narrow", TinyModelSpec(hidden_size=32, num_attention_heads=2,
                                                                      num_key_value_heads=1))
    with start_engine_process(tiny_model_dir, log_path=tmp_path / "e0.log") as good, \
            start_engine_process(other_model, log_path=tmp_path / "e1.log") as wrong:
        with anyio.fail_after(240):
            async with EngineClient(max_connections=8) as client, anyio.create_task_group() as tg:
                group: TrainGroup = await tg.start(TrainGroup(nproc_per_node=1, run_dir=tmp_path / "run").run)
                await group.init(flat_settings({**TRAIN_CONFIG, "model_path": str(tiny_model_dir)}))
                fleet = EngineFleet(client=client, external_urls=[good.url, wrong.url], run_dir=tmp_path)
                await tg.start(fleet.run)
                sync = WeightSync(mode="distributed", fleet=fleet, client=client, trainer=group,
                                  snapshot_dir=tmp_path / "snapshots", bucket_bytes=24 * 1024, join_timeout_s=60)
                started = time.monotonic()
                with pytest.raises(WeightSyncError) as failure:
                    await sync.distributed.run(fleet.alive(), "1")
                assert time.monotonic() - started < 30  # not the 60 s a send waits for a missing receiver
                message = str(failure.value)
                assert "\n" not in message
                assert f"rollout-ext-1 ({wrong.url}): /update_weights_from_distributed (bucket 1 of" in message
                assert "shape" in message and "rollout-ext-0" not in message, message
                assert await client.engine(good.url).get_weight_version() == "1"
                assert await client.engine(wrong.url).get_weight_version() != "1"
                await group.shutdown()
                tg.cancel_scope.cancel()
