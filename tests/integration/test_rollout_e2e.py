"""The generate path end to end against real CPU engines launched by the real fleet.

The tests that leave their engines as they found them share one two-engine fleet (`shared_fleet`, started
once per module: engines take seconds of CPU to start); the one that kills an engine starts its own.
"""

from __future__ import annotations

import math
import os
import signal
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest

from coordinator.config import parse_config
from coordinator.data.source import PromptRecord
from coordinator.engines.client import EngineClient
from coordinator.engines.fleet import EngineFleet
from coordinator.engines.spec import EngineLaunchSpec
from coordinator.observe.progress import ProgressDisplay
from coordinator.rollout.manager import RolloutManager
from replay.format import dump_path
from replay.reader import read_dump
from replay.sample import RolloutBatch, Sample, SampleStatus
from tests.support.rollout_fns import RecordedDefaultRollout
from tests.support.waiting import wait_until


@asynccontextmanager
async def running_fleet(model_dir: Path, run_dir: Path, engines: int = 2) -> AsyncIterator[tuple[EngineClient, EngineFleet]]:
    spec = EngineLaunchSpec(kind="rayless", model_path=str(model_dir),
                            extra_args=("--weight-version", "0", "--random-seed", "0"),
                            env=(("RAYLESS_ENGINE_THREADS", "1"),))
    async with EngineClient(max_connections=64) as client, anyio.create_task_group() as group:
        fleet = EngineFleet(client=client, launch=spec, num_engines=engines, run_dir=run_dir, probe_timeout=5)
        await group.start(fleet.run)
        yield client, fleet
        group.cancel_scope.cancel()


@pytest.fixture(scope="module")
async def shared_fleet(tiny_model_dir: Path,
                       tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[tuple[EngineClient, EngineFleet]]:
    """Two engines for the tests that kill none (each builds its own manager, so no rollout state is shared)."""
    async with running_fleet(tiny_model_dir, tmp_path_factory.mktemp("shared-fleet")) as pair:
        yield pair


def build_manager(model_dir: Path, client: EngineClient, fleet: EngineFleet, *flags: str,
                  progress: ProgressDisplay | None = None) -> RolloutManager:
    from transformers import AutoTokenizer

    config = parse_config(["--hf-checkpoint", str(model_dir), "--rollout-num-engines", str(len(fleet.engines)),
                           "--prompt-data", "builtin:first_digit", "--num-rollout", "1", *flags])
    return RolloutManager.build(config, tokenizer=AutoTokenizer.from_pretrained(model_dir), client=client,
                                pool=fleet, context_length=512, progress=progress)


def generated_tokens(display: ProgressDisplay) -> int:
    """Tokens the rollout generating now has generated so far (its progress line's source); 0 before it starts."""
    current: Any = display.current
    return 0 if current is None else int(current[1].generated_tokens)


def assert_consistent(batch: RolloutBatch, groups: int, n: int, *, one_engine_per_group: bool = True) -> None:
    assert len(batch.groups) == groups
    seen = set()
    for group_index, group in enumerate(batch.groups):
        assert len(group) == n
        assert sorted(s.sample_index for s in group) == list(range(n))
        if one_engine_per_group:
            assert len({s.metadata["engine"] for s in group}) == 1, "a group's samples must share one engine"
        assert len({s.metadata["prompt_index"] for s in group}) == 1
        rewards = [s.reward for s in group]
        advantages = [s.advantage for s in group]
        assert abs(sum(advantages)) < 1e-6 * n + 1e-9  # GRPO: centred within the group
        if len(set(rewards)) > 1:
            assert any(a != 0 for a in advantages)
        for sample in group:
            sample.validate()
            assert sample.group_index == group_index
            assert sample.status in (SampleStatus.COMPLETED, SampleStatus.TRUNCATED)
            assert sample.response_length >= 1 and sample.loss_mask == [1] * sample.response_length
            assert all(lp <= 0 and math.isfinite(lp) for lp in sample.rollout_log_probs)
            assert sample.tokens[: sample.prompt_length] == sample.tokens[: len(sample.tokens) - sample.response_length]
            assert 0.0 <= float(sample.reward) <= 1.0  # type: ignore[arg-type]
            assert sample.weight_versions == ["0"]
            key = (sample.metadata["prompt_index"], sample.sample_index, tuple(sample.tokens))
            assert key not in seen, "duplicated sample"
            seen.add(key)


async def test_rollout_against_two_engines_returns_the_full_consistent_batch(
        tiny_model_dir: Path, tmp_path: Path, shared_fleet: tuple[EngineClient, EngineFleet]) -> None:
    template = str(tmp_path / "dumps" / "{rollout_id}.rld")
    client, fleet = shared_fleet
    manager = build_manager(tiny_model_dir, client, fleet, "--rollout-batch-size", "6",
                            "--n-samples-per-prompt", "4", "--rollout-max-response-len", "4",
                            "--save-debug-rollout-data", template, "--log-passrate")
    assert manager.counts["generate_states"] == 1 and manager.counts["dispatchers"] == 1
    assert manager.built_generate_state is not None
    assert manager.built_generate_state.concurrency == 2 * 512
    batch = await manager.get_rollout(0, "0")
    used_engines = {s.metadata["engine"] for s in batch.samples}
    assert_consistent(batch, groups=6, n=4)
    assert len(used_engines) == 2, "least-in-flight dispatch spreads groups over both engines"
    assert batch.metrics["rollout/reward_mean"] == sum(s.reward for s in batch.samples) / 24  # type: ignore[misc]
    # Each engine's tokens/s (the status page's and /metrics' figure) is its responses' tokens over the rollout's
    # seconds; together they are the rollout's rate, the terminal's.
    seconds = batch.metrics["rollout/time_s"]
    for handle in fleet.engines:
        tokens = sum(s.response_length for s in batch.samples if s.metadata["engine"] == handle.url)
        assert batch.metrics[f"rollout/tokens_per_s/{handle.name}"] == pytest.approx(tokens / seconds)
    assert sum(batch.metrics[f"rollout/tokens_per_s/{h.name}"] for h in fleet.engines) == pytest.approx(
        batch.metrics["rollout/tokens_per_s"])
    # --log-passrate: with equal groups pass@1 is the share of right samples, pass@4 the share of groups with one
    right = [sum(s.reward >= 1.0 for s in group) for group in batch.groups]  # type: ignore[operator]
    assert batch.metrics["passrate/pass@1"] == pytest.approx(sum(right) / 24)
    assert batch.metrics["passrate/pass@4"] == pytest.approx(sum(c > 0 for c in right) / 6)
    assert batch.metrics["passrate/pass@1"] <= batch.metrics["passrate/pass@2"] <= batch.metrics["passrate/pass@4"]
    dumped = read_dump(dump_path(template, 0))
    assert dumped.header.rollout_id == 0
    assert [s.tokens for s in dumped.samples] == [s.tokens for s in batch.samples]
    assert [s.advantage for s in dumped.samples] == [s.advantage for s in batch.samples]


async def test_killing_an_engine_mid_rollout_loses_and_duplicates_nothing(tiny_model_dir: Path,
                                                                          tmp_path: Path) -> None:
    async with running_fleet(tiny_model_dir, tmp_path) as (client, fleet):
        display = ProgressDisplay(enabled=False)
        # 32 requests of 32 tokens, 16 in flight: the kill at 200 tokens finds requests running on both engines
        manager = build_manager(tiny_model_dir, client, fleet, "--rollout-batch-size", "8",
                                "--n-samples-per-prompt", "4", "--rollout-max-response-len", "32",
                                "--sglang-server-concurrency", "8", progress=display)
        victim = fleet.engines[0]
        result: list[RolloutBatch] = []

        async def rollout() -> None:
            result.append(await manager.get_rollout(0, "0"))

        async with anyio.create_task_group() as group:
            group.start_soon(rollout)
            await wait_until(lambda: generated_tokens(display), until=lambda tokens: tokens >= 200, timeout=60,
                             what="200 tokens generated by the rollout")
            assert victim.process is not None and victim.process.pid is not None
            os.killpg(victim.process.pid, signal.SIGKILL)
        assert not victim.alive, "the fleet marks the killed engine dead"
        assert manager.context is not None and manager.context.dispatcher.retried > 0
    batch = result[0]
    # requests retried after the kill finish on the other engine, so a group may span both here
    assert_consistent(batch, groups=8, n=4, one_engine_per_group=False)
    assert {s.metadata["engine"] for s in batch.samples} >= {fleet.engines[1].url}


async def test_dynamic_filter_drops_constant_reward_groups_and_replaces_them(
        tiny_model_dir: Path, shared_fleet: tuple[EngineClient, EngineFleet]) -> None:
    client, fleet = shared_fleet
    manager = build_manager(tiny_model_dir, client, fleet, "--rollout-batch-size", "4",
                            "--n-samples-per-prompt", "2", "--rollout-max-response-len", "2",
                            "--custom-rm-path", "tests.support.rollout_fns:alternating_constant_reward",
                            "--dynamic-sampling-filter-path",
                            "coordinator.rollout.filters:reward_std_positive")
    batch = await manager.get_rollout(0, "0")
    assert len(batch.groups) == 4
    for group in batch.groups:
        assert group[0].metadata["prompt_index"] % 2 == 1
        assert len({s.reward for s in group}) > 1
    # Four odd prompts accepted means prompts 0..7 were dispatched; an even group still in flight when the
    # fourth odd one lands is aborted, not filtered, so only "some dropped, every drop counted" is certain.
    dropped = batch.metrics["rollout/filter_drop/zero_std"]
    assert dropped >= 1
    assert batch.metrics["rollout/filtered_groups"] == dropped


async def test_stragglers_are_aborted_and_partial_rollout_continues_them_next_time(
        tiny_model_dir: Path, shared_fleet: tuple[EngineClient, EngineFleet]) -> None:
    client, fleet = shared_fleet
    built = len(RecordedDefaultRollout.BUILT)
    manager = build_manager(tiny_model_dir, client, fleet, "--rollout-batch-size", "2",
                            "--over-sampling-batch-size", "12", "--n-samples-per-prompt", "2",
                            "--rollout-max-response-len", "64", "--sglang-server-concurrency", "4",
                            "--partial-rollout",
                            "--rollout-function-path", "tests.support.rollout_fns:RecordedDefaultRollout")
    rollout_fn = RecordedDefaultRollout.BUILT[built]  # the rollout function (the eval one comes next)
    first = await manager.get_rollout(0, "0")
    assert len(first.groups) == 2 and first.metrics["rollout/aborted_stragglers"] > 0
    buffered = rollout_fn.partial_buffer
    assert first.metrics["rollout/partial_buffer"] == len(buffered)
    assert buffered, "aborted stragglers go to the partial-rollout buffer"
    started = {(g.record.index, s.sample_index): s.response_length for g in buffered for s in g.samples}
    assert any(length > 0 for length in started.values()), "some stragglers had generated tokens"
    # nothing is still running on either engine: the stragglers were aborted, not awaited
    for engine in fleet.engines:
        metrics = await client.engine(engine.url).metrics()
        running = [line for line in metrics.splitlines() if line.startswith("sglang:num_running_reqs")]
        assert running and float(running[0].rsplit(" ", 1)[1]) == 0.0, (engine.url, running)
    second = await manager.get_rollout(1, "1")
    assert len(second.groups) == 2
    continued = [s for s in second.samples if started.get((s.metadata["prompt_index"], s.sample_index), 0) > 0]
    # resumed groups are submitted first and need fewer tokens, so they are among the accepted ones;
    # each continued sample kept its earlier tokens and grew
    assert continued
    for sample in continued:
        assert sample.response_length >= started[(sample.metadata["prompt_index"], sample.sample_index)]
        assert len(sample.rollout_log_probs) == sample.response_length


async def test_an_engine_reply_is_decoded_once_and_changes_form_four_times_on_its_way_to_a_micro_batch(
        tiny_model_dir: Path, shared_fleet: tuple[EngineClient, EngineFleet], monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/architecture.md#data-flow: bytes → GenerateReply → Sample → WireSample → micro-batch. One group through
    the real generate path (dispatcher, engine client, a real engine): the answer's bytes are decoded once (the
    typed schema; no plain-JSON decode, no generic check beside it), and each seam hands the next the form named."""
    from transformers import AutoTokenizer

    from coordinator.engines import reply_decode
    from coordinator.engines.replies import GenerateReply
    from coordinator.rollout import requests
    from coordinator.rollout.dispatch import Dispatcher
    from coordinator.train.planning import plan_steps
    from workers.protocol import WireSample
    from workers.protocol.train_settings import BatchingSettings
    from workers.train_rank.batching import MicroBatch
    from workers.train_rank.packing import pack

    client, fleet = shared_fleet
    decodes: list[str] = []
    typed, plain, generic_check = reply_decode._ANSWER, msgspec.json.decode, reply_decode.check_generate_body

    class CountingDecoder:  # counts, then decodes with the real decoder
        def decode(self, raw: bytes) -> object:
            decodes.append("typed")
            return typed.decode(raw)

    def counting_plain(raw: bytes, *args: Any, **kwargs: Any) -> Any:
        decodes.append("plain")
        return plain(raw, *args, **kwargs)

    def counting_check(*args: Any, **kwargs: Any) -> Any:
        decodes.append("generic check")
        return generic_check(*args, **kwargs)

    seams: list[tuple[str, str]] = []
    apply_response = requests.apply_response

    def recorded_apply(state: Any, sample: Any, reply: Any, **kwargs: Any) -> int:
        seams.append((type(reply).__name__, type(sample).__name__))
        return apply_response(state, sample, reply, **kwargs)

    monkeypatch.setattr(reply_decode, "_ANSWER", CountingDecoder())
    monkeypatch.setattr(msgspec.json, "decode", counting_plain)
    monkeypatch.setattr(reply_decode, "check_generate_body", counting_check)
    monkeypatch.setattr(requests, "apply_response", recorded_apply)
    state = requests.GenerateState(tokenizer=AutoTokenizer.from_pretrained(tiny_model_dir),
                                   sampling_params={"temperature": 1.0}, max_response_len=3, context_length=64,
                                   concurrency=4, seed=1)
    record = PromptRecord(prompt="3 7 1=", label="3", index=0)
    prompt_ids = state.encode("3 7 1=")
    samples = [requests.new_sample(record, prompt_ids, 0, index, n_samples=3) for index in range(3)]
    dispatcher = Dispatcher(client=client, pool=fleet, watch_engine_state=False)
    await requests.generate_group(state, dispatcher, samples, rollout_id=0)

    assert decodes == ["typed"], "one batched answer for the group, decoded once"
    assert seams == [(GenerateReply.__name__, Sample.__name__)] * 3
    for sample in samples:
        sample.advantage = 0.5
    wire = [WireSample.from_sample(sample) for sample in samples]
    assert all(type(item) is WireSample and item.response_length == s.response_length >= 1
               for item, s in zip(wire, samples, strict=True))
    (step,) = plan_steps(wire, BatchingSettings(), world_size=1)
    batch = pack(step.shards[0], pad_token_id=0)
    assert type(batch) is MicroBatch
    assert batch.num_tokens == sum(len(s.tokens) for s in samples)
    assert float(batch.loss_mask.sum()) == sum(s.response_length for s in samples)
