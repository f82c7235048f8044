"""Our trainer updates an engine side run by SGLang's own code (the real sglang wheel), through `WeightSync`.

The trainer is a real torchrun group (`TrainGroup`, two ranks, started once for the module: `updates` runs both
scenarios on it and records what they saw; the tests read the records); the engine side is
`tests.support.sglang_receiver`, whose group and receive loop are SGLang 0.5.x's `init_custom_process_group` and
`receive_weights_from_distributed`. What proves the contract: after an update, the log-probabilities the
receiver computes with the weights it received are the ones training computes (the trainer's own check,
`train_rollout_logprob_abs_diff_max`, with the receiver's numbers as the rollout's) to 1e-4, while before the
update they were far apart. The reverse direction (a trainer built for SGLang into our engine) is in
test_engine_weights.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import httpx
import msgspec
import pytest

from coordinator.engines.client import EngineClient
from coordinator.engines.fleet import EngineFleet
from coordinator.train.group import TrainGroup
from coordinator.train.torchrun import TorchrunSpec
from coordinator.weights.distributed import FLATTENED_BUCKET
from coordinator.weights.sync import WeightSync
from tests.support.engine_proc import RunningEngine, start_engine_process
from tests.support.train_samples import TRAIN_CONFIG, as_samples, synthetic_samples
from tests.support.train_settings import flat_settings
from workers import protocol

BUCKET_BYTES = 24 * 1024  # the tiny model's 320 KB in more than ten buckets, some holding several tensors
TRAIN = {**TRAIN_CONFIG, "lr": 1e-2, "warmup_steps": 0, "global_batch_size": 8}


@dataclass
class BucketedUpdate:
    """One update of the tp-1 receiver in broadcast mode, with one load format."""

    load_format: str | None
    stale: list[list[float]]  # the receiver's logprobs before the update (training had moved the weights)
    fresh: list[list[float]]  # ... and after it
    metrics: dict[str, float]  # training on `fresh` as the rollout's logprobs
    requests: list[dict[str, Any]]  # the receiver's record of the update's requests


@dataclass
class Updates:
    tensors: int = 0
    buckets: list[list[tuple[str, str, list[int]]]] = field(default_factory=list)
    bucketed: list[BucketedUpdate] = field(default_factory=list)
    receiver_inits: list[dict[str, Any]] = field(default_factory=list)
    tp2_init: dict[str, Any] = field(default_factory=dict)
    tp2_metrics: dict[str, float] = field(default_factory=dict)
    ours_version: Any = None


async def receiver_logprobs(url: str, samples: list[protocol.WireSample]) -> list[list[float]]:
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        response = await http.post("/logprobs", json={"tokens": [s.tokens.tolist() for s in samples],
                                                      "response_lengths": [s.response_length for s in samples]})
        response.raise_for_status()
        return response.json()["logprobs"]


async def stats(url: str) -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        return (await http.get("/stats")).json()


def with_rollout_logprobs(samples: list[protocol.WireSample], logprobs: list[list[float]]) -> list[Any]:
    # WireSample is a msgspec Struct (workers.protocol's message layer), not a dataclass
    return as_samples([msgspec.structs.replace(s, rollout_log_probs=lp) for s, lp in zip(samples, logprobs, strict=True)])


async def by_bucket_and_per_tensor(record: Updates, client: EngineClient, group: TrainGroup, model: Path,
                                   receiver: RunningEngine, run_dir: Path) -> None:
    samples = synthetic_samples(model, 8, seed=21)
    async with anyio.create_task_group() as tg:
        fleet = EngineFleet(client=client, external_urls=[receiver.url], run_dir=run_dir)
        await tg.start(fleet.run)
        sync = WeightSync(mode="broadcast", fleet=fleet, client=client, trainer=group.commands,
                          snapshot_dir=run_dir / "snapshots", bucket_bytes=BUCKET_BYTES, join_timeout_s=60)
        record.buckets = await group.commands.weight_buckets(BUCKET_BYTES)
        record.tensors = len(await group.commands.weight_manifest())
        for rollout_id, load_format in enumerate([FLATTENED_BUCKET, None]):
            await group.commands.train(rollout_id, as_samples(samples))  # the weights move away from the receiver's
            stale = await receiver_logprobs(receiver.url, samples)
            sync.distributed.load_format = load_format
            await sync.update(str(rollout_id + 1))
            fresh = await receiver_logprobs(receiver.url, samples)
            # Training recomputes the logprobs of the receiver's weights (they are the trainer's now).
            metrics = await group.commands.train(10 + rollout_id, with_rollout_logprobs(samples, fresh))
            requests = (await stats(receiver.url))["updates"][-len(record.buckets):]
            record.bucketed.append(BucketedUpdate(load_format, stale, fresh, metrics, requests))
        record.receiver_inits = (await stats(receiver.url))["inits"]
        tg.cancel_scope.cancel()


async def into_tensor_parallel_engines(record: Updates, client: EngineClient, group: TrainGroup, model: Path,
                                       tp2: RunningEngine, ours: RunningEngine, run_dir: Path) -> None:
    samples = synthetic_samples(model, 8, seed=22)
    async with anyio.create_task_group() as tg:
        fleet = EngineFleet(client=client, external_urls=[tp2.url, ours.url], run_dir=run_dir)
        await tg.start(fleet.run)
        sync = WeightSync(mode="distributed", fleet=fleet, client=client, trainer=group.commands,
                          snapshot_dir=run_dir / "snapshots", bucket_bytes=BUCKET_BYTES, join_timeout_s=60)
        await group.commands.train(20, as_samples(samples))
        await sync.update("tp-1")  # also checks that both engines report version "tp-1"
        record.tp2_init = (await stats(tp2.url))["inits"][-1]
        fresh = await receiver_logprobs(tp2.url, samples)
        record.tp2_metrics = await group.commands.train(21, with_rollout_logprobs(samples, fresh))
        async with httpx.AsyncClient(base_url=ours.url, timeout=60) as http:
            record.ours_version = (await http.get("/get_weight_version")).json()
        tg.cancel_scope.cancel()


@pytest.fixture(scope="module")
async def updates(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Updates:
    """One tp-1 receiver; one SGLang-side engine with tp 2 (two processes, ranks 1 and 2) answering as SGLang
    0.5.20 and older (no begin/end session endpoints: 404, tolerated) beside our CPU engine (rank 3)."""
    root = tmp_path_factory.mktemp("sync-sglang")
    record = Updates()
    model, receiver_module = tiny_model_dir, "tests.support.sglang_receiver"
    with start_engine_process(model, module=receiver_module, log_path=root / "receiver.log") as receiver, \
            start_engine_process(model, module=receiver_module, extra_args=["--tp-size", "2", "--before-sessions"],
                                 log_path=root / "tp2.log") as tp2, \
            start_engine_process(model, log_path=root / "engine.log") as ours:
        with anyio.fail_after(240):
            async with EngineClient(max_connections=8) as client, anyio.create_task_group() as tg:
                group: TrainGroup = await tg.start(TrainGroup(TorchrunSpec(nproc_per_node=2), run_dir=root / "run").run)
                await group.commands.init(flat_settings({**TRAIN, "model_path": str(model)}))
                await by_bucket_and_per_tensor(record, client, group, model, receiver, root / "bucketed")
                await into_tensor_parallel_engines(record, client, group, model, tp2, ours, root / "tp")
                await group.shutdown()
                tg.cancel_scope.cancel()
    return record


async def test_sglangs_receive_code_gets_our_trainers_weights_by_bucket_and_per_tensor(updates: Updates) -> None:
    buckets = updates.buckets
    assert 10 < len(buckets) < updates.tensors  # some buckets hold several tensors
    assert [u.load_format for u in updates.bucketed] == [FLATTENED_BUCKET, None]
    for update in updates.bucketed:
        moved = max(abs(a - b) for s, f in zip(update.stale, update.fresh, strict=True)
                    for a, b in zip(s, f, strict=True))
        assert moved > 1e-3
        assert update.metrics["train_rollout_logprob_abs_diff_max"] <= 1e-4, update.metrics
        assert [r["names"] for r in update.requests] == [[name for name, _, _ in b] for b in buckets]
        assert {r["load_format"] for r in update.requests} == {update.load_format}
        assert all(r["bytes"] <= BUCKET_BYTES or len(r["names"]) == 1 for r in update.requests)
    inits = updates.receiver_inits
    assert [(i["rank_offset"], i["world_size"], i["backend"]) for i in inits] == [(1, 2, "gloo")] * 2
    assert len({i["group_name"] for i in inits}) == 2  # a fresh group per update


async def test_tensor_parallel_engines_count_every_tp_rank_in_the_group(updates: Updates) -> None:
    """World 4: trainer rank 0, the tp-2 engine's ranks 1 and 2, our engine's rank 3."""
    assert (updates.tp2_init["rank_offset"], updates.tp2_init["world_size"]) == (1, 4)
    assert updates.tp2_metrics["train_rollout_logprob_abs_diff_max"] <= 1e-4, updates.tp2_metrics
    assert updates.ours_version == {"weight_version": "tp-1"}
