"""Our trainer updates an engine side run by SGLang's own code (the real sglang wheel), through `WeightSync`.

The trainer is a real torchrun group (`TrainGroup`); the engine side is `tests.support.sglang_receiver`, whose
group and receive loop are SGLang 0.5.x's `init_custom_process_group` and `receive_weights_from_distributed`.
What proves the contract: after an update, the log-probabilities the receiver computes with the weights it
received are the ones training computes (the trainer's own check, `train_rollout_logprob_abs_diff_max`, with
the receiver's numbers as the rollout's) to 1e-4, while before the update they were far apart. The reverse
direction (a trainer built for SGLang into our engine) is in test_engine_weights.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import msgspec
import pytest

from coordinator.engines.client import EngineClient
from coordinator.engines.fleet import EngineFleet
from coordinator.train.group import TrainGroup
from coordinator.weights.distributed import FLATTENED_BUCKET
from coordinator.weights.sync import WeightSync
from tests.support.engine_proc import RunningEngine, start_engine_process
from tests.support.train_samples import TRAIN_CONFIG, as_samples, synthetic_samples
from tests.support.train_settings import flat_settings
from workers import protocol

BUCKET_BYTES = 24 * 1024  # the tiny model's 320 KB in more than ten buckets, some holding several tensors
TRAIN = {**TRAIN_CONFIG, "lr": 1e-2, "warmup_steps": 0, "global_batch_size": 8}


@pytest.fixture
def receiver(tiny_model_dir: Path, tmp_path: Path) -> Iterator[RunningEngine]:
    with start_engine_process(tiny_model_dir, module="tests.support.sglang_receiver",
                              log_path=tmp_path / "receiver.log") as process:
        yield process


async def receiver_logprobs(url: str, samples: list[protocol.WireSample]) -> list[list[float]]:
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        response = await http.post("/logprobs", json={"tokens": [s.tokens for s in samples],
                                                      "response_lengths": [s.response_length for s in samples]})
        response.raise_for_status()
        return response.json()["logprobs"]


async def stats(url: str) -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        return (await http.get("/stats")).json()


def with_rollout_logprobs(samples: list[protocol.WireSample], logprobs: list[list[float]]) -> list[Any]:
    # WireSample is a msgspec Struct (workers.protocol's message layer), not a dataclass
    return as_samples([msgspec.structs.replace(s, rollout_log_probs=lp) for s, lp in zip(samples, logprobs, strict=True)])


async def test_sglangs_receive_code_gets_our_trainers_weights_by_bucket_and_per_tensor(
    tiny_model_dir: Path, tmp_path: Path, receiver: RunningEngine
) -> None:
    samples = synthetic_samples(tiny_model_dir, 8, seed=21)
    with anyio.fail_after(240):
        async with EngineClient(max_connections=8) as client, anyio.create_task_group() as tg:
            group: TrainGroup = await tg.start(TrainGroup(nproc_per_node=2, run_dir=tmp_path / "run").run)
            await group.init(flat_settings({**TRAIN, "model_path": str(tiny_model_dir)}))
            fleet = EngineFleet(client=client, external_urls=[receiver.url], run_dir=tmp_path)
            await tg.start(fleet.run)
            sync = WeightSync(mode="broadcast", fleet=fleet, client=client, trainer=group,
                              snapshot_dir=tmp_path / "snapshots", bucket_bytes=BUCKET_BYTES, join_timeout_s=60)
            buckets = await group.weight_buckets(BUCKET_BYTES)
            assert 10 < len(buckets) < len(await group.weight_manifest())  # some buckets hold several tensors

            for rollout_id, load_format in enumerate([FLATTENED_BUCKET, None]):
                await group.train(rollout_id, as_samples(samples))  # the weights move away from the receiver's
                stale = await receiver_logprobs(receiver.url, samples)
                sync.distributed.load_format = load_format
                await sync.update(str(rollout_id + 1))
                fresh = await receiver_logprobs(receiver.url, samples)
                assert max(abs(a - b) for s, f in zip(stale, fresh, strict=True) for a, b in zip(s, f, strict=True)) > 1e-3
                # Training recomputes the logprobs of the receiver's weights (they are the trainer's now).
                metrics = await group.train(10 + rollout_id, with_rollout_logprobs(samples, fresh))
                assert metrics["train_rollout_logprob_abs_diff_max"] <= 1e-4, metrics
                requests = (await stats(receiver.url))["updates"][-len(buckets):]
                assert [r["names"] for r in requests] == [[name for name, _, _ in b] for b in buckets]
                assert {r["load_format"] for r in requests} == {load_format}
                assert all(r["bytes"] <= BUCKET_BYTES or len(r["names"]) == 1 for r in requests)

            inits = (await stats(receiver.url))["inits"]
            assert [(i["rank_offset"], i["world_size"], i["backend"]) for i in inits] == [(1, 2, "gloo")] * 2
            assert len({i["group_name"] for i in inits}) == 2  # a fresh group per update
            await group.shutdown()
            tg.cancel_scope.cancel()


async def test_tensor_parallel_engines_count_every_tp_rank_in_the_group(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """One SGLang-side engine with tp 2 (two processes, ranks 1 and 2) and our CPU engine (rank 3): world 4.
    The tp-2 engine answers as SGLang 0.5.20 and older (no begin/end session endpoints: 404, tolerated)."""
    samples = synthetic_samples(tiny_model_dir, 8, seed=22)
    with start_engine_process(tiny_model_dir, module="tests.support.sglang_receiver", extra_args=["--tp-size", "2", "--before-sessions"],
                              log_path=tmp_path / "receiver.log") as tp2, \
            start_engine_process(tiny_model_dir, log_path=tmp_path / "engine.log") as ours:
        with anyio.fail_after(240):
            async with EngineClient(max_connections=8) as client, anyio.create_task_group() as tg:
                group: TrainGroup = await tg.start(TrainGroup(nproc_per_node=1, run_dir=tmp_path / "run").run)
                await group.init(flat_settings({**TRAIN, "model_path": str(tiny_model_dir)}))
                fleet = EngineFleet(client=client, external_urls=[tp2.url, ours.url], run_dir=tmp_path)
                await tg.start(fleet.run)
                sync = WeightSync(mode="distributed", fleet=fleet, client=client, trainer=group,
                                  snapshot_dir=tmp_path / "snapshots", bucket_bytes=BUCKET_BYTES, join_timeout_s=60)
                await group.train(0, as_samples(samples))
                await sync.update("1")  # also checks that both engines report version "1"
                init = (await stats(tp2.url))["inits"][-1]
                assert (init["rank_offset"], init["world_size"]) == (1, 4)
                fresh = await receiver_logprobs(tp2.url, samples)
                metrics = await group.train(1, with_rollout_logprobs(samples, fresh))
                assert metrics["train_rollout_logprob_abs_diff_max"] <= 1e-4, metrics
                async with httpx.AsyncClient(base_url=ours.url, timeout=60) as http:
                    assert (await http.get("/get_weight_version")).json() == {"weight_version": "1"}
                await group.shutdown()
                tg.cancel_scope.cancel()
