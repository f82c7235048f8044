"""A hostile engine (tests/support/hostile_engine.py, a real server) beside one real CPU engine.

Each bad `/generate` reply of issue 24 (nested 100k deep, 300 MB, ids and logprobs of different lengths, empty
or out-of-vocabulary ids, an unhashable finish reason, a NaN logprob, float ids) is refused by the engine client
as one `EngineReplyError`, counted per peer by the dispatcher, and its request answered by the real engine; the
300 MB reply is cut at its cap (memory growth bounded). An engine that drips its reply, or wedges, costs the
stall bound, one that answers /health but never finishes a generate costs its request's generation bound, and
the request is answered by the real engine. An engine that never acknowledges a weight load (as on a resume,
whose engines load the checkpoint's weights through the same update) is named within the acknowledgment
deadline: the update fails in one line, or, with rollout FT, the engine is marked dead and the update reaches
the real one. Then one real `rayless train` run with the hostile engine
attached by `--rollout-external-engine-addrs`: it completes, the refused replies are in its metrics, no
traceback.
"""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import anyio
import httpx
import pytest
from transformers import AutoConfig

from coordinator.engines.client import EngineClient
from coordinator.engines.errors import EngineHTTPError, EngineReplyError
from coordinator.engines.fleet import EngineFleet
from coordinator.engines.policy import NO_RETRY
from coordinator.lifecycle.processes import terminate_process_group_blocking
from coordinator.rollout.dispatch import Dispatcher, NoEngineAvailable
from tests.support.engine_proc import free_port, start_engine
from tests.support.hostile_engine import BAD_MODES, STALL_MODES, HostileEngine
from tests.support.memory import PeakMemory

# 64 tokens each: a cap of ~224 KB, above the 200 KB of the deeply nested reply, so its depth is what is refused
PAYLOAD = {"input_ids": [[1, 2, 3], [1, 2, 3]], "return_logprob": True,
           "sampling_params": [{"max_new_tokens": 64, "temperature": 0.0}] * 2}
#: what each refusal says (the reason logged with the peer)
REASONS = {
    "mismatch": r"3 output ids but 2 logprobs", "empty": r"no output ids", "oov": r"token id 1000000, outside",
    "unhashable_finish": r"finish_reason is \{'type': \['stop'\]\}", "float_ids": r"holds 6\.5 \(float\)",
    "bool_ids": r"holds True \(bool\)", "inf_logprob": r"Number out of range", "deep": r"nested deeper than",
    "huge": r"passed the limit of \d+ bytes", "nan_logprob": r"not valid JSON", "not_json": r"not valid JSON",
}


@pytest.fixture(scope="module")
def real_engine(tiny_model_dir: Path) -> Iterator[str]:
    with start_engine(tiny_model_dir) as url:
        yield url


@pytest.fixture
async def fleet_with(real_engine: str, tiny_model_dir: Path, tmp_path: Path,
                     request: pytest.FixtureRequest) -> AsyncIterator[tuple[Dispatcher, HostileEngine]]:
    async with anyio.create_task_group() as group, EngineClient(max_connections=8, retry=NO_RETRY) as client:
        client.set_vocab_size(AutoConfig.from_pretrained(tiny_model_dir).vocab_size)
        hostile = await group.start(HostileEngine(request.param).run)
        addrs = [real_engine.removeprefix("http://"), hostile.url.removeprefix("http://")]
        fleet = EngineFleet(client=client, external_urls=addrs, run_dir=tmp_path, group="hostile")
        await group.start(fleet.run)
        yield Dispatcher(client=client, pool=fleet, watch_engine_state=False), hostile
        group.cancel_scope.cancel()


@pytest.mark.parametrize("fleet_with", BAD_MODES, indirect=True)
async def test_a_hostile_reply_is_refused_counted_and_answered_elsewhere(
        fleet_with: tuple[Dispatcher, HostileEngine], real_engine: str, caplog: pytest.LogCaptureFixture) -> None:
    dispatcher, hostile = fleet_with
    (handle,) = [h for h in dispatcher.pool.alive() if h.url == hostile.url]  # type: ignore[union-attr]
    memory = PeakMemory()
    with caplog.at_level(logging.WARNING, logger="coordinator.rollout.dispatch"):
        answer, url = await dispatcher.generate(dict(PAYLOAD), engine=handle)
    growth = memory.growth_mib
    assert (url, hostile.generated, dict(dispatcher.refused)) == (real_engine, 1, {hostile.url: 1})
    (warning,) = [r.getMessage() for r in caplog.records if "refused a reply from" in r.getMessage()]
    assert hostile.url in warning and re.search(REASONS[hostile.mode], warning), warning
    for reply in answer.replies:  # the real engine's answers, whole
        assert 1 <= len(reply.output_ids) == len(reply.logprobs or ()) <= 64
    assert growth < 256, f"{hostile.mode}: the coordinator grew {growth:.0f} MiB refusing one reply"
    # Kept out of picks for a while: the next request goes to the real engine without asking the hostile one.
    _, url = await dispatcher.generate(dict(PAYLOAD))
    assert (url, hostile.generated) == (real_engine, 1)


@pytest.mark.parametrize("fleet_with", ["float_ids"], indirect=True)
async def test_a_hostile_stream_chunk_is_refused(fleet_with: tuple[Dispatcher, HostileEngine]) -> None:
    dispatcher, hostile = fleet_with
    with pytest.raises(EngineReplyError, match=r"6\.5"):
        async for _ in dispatcher.client.engine(hostile.url).generate_stream({"input_ids": [1], "stream": True}):
            pass


async def test_a_hostile_error_answer_is_one_http_error() -> None:
    async with anyio.create_task_group() as group, EngineClient(max_connections=2, retry=NO_RETRY) as client:
        hostile = await group.start(HostileEngine("deep_error").run)
        with pytest.raises(EngineHTTPError) as caught:
            await client.engine(hostile.url).generate({"input_ids": [1]})
        assert caught.value.status == 500 and len(caught.value.server_message) <= 64 << 10
        group.cancel_scope.cancel()


def test_a_run_beside_a_hostile_engine_completes_and_counts_its_refused_replies(
        real_engine: str, tiny_model_dir: Path, tmp_path: Path) -> None:
    port = free_port()
    hostile = subprocess.Popen([sys.executable, "-m", "tests.support.hostile_engine", "cycle", str(port)],
                               stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert hostile.stdout is not None and hostile.stdout.readline().startswith("ready")
        run_dir = tmp_path / "run"
        result = subprocess.run(
            [sys.executable, "-m", "coordinator.cli", "train", "--no-progress", "--hf-checkpoint", str(tiny_model_dir),
             "--prompt-data", "builtin:first_digit", "--debug-rollout-only", "--rollout-external-engine-addrs",
             real_engine.removeprefix("http://"), f"127.0.0.1:{port}", "--rollout-batch-size", "2",
             "--n-samples-per-prompt", "2", "--num-rollout", "1", "--rollout-max-response-len", "4",
             "--run-dir", str(run_dir)],
            capture_output=True, text=True, timeout=300, check=False)
        assert result.returncode == 0, result.stderr[-3000:]
        assert "Traceback" not in result.stderr
        served = httpx.get(f"http://127.0.0.1:{port}/hostile_stats", timeout=10).json()["generated"]
        lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        refused = [line["rollout/refused_replies"] for line in lines if "rollout/refused_replies" in line]
        assert served >= 1 and refused and refused[-1] == served  # every hostile reply refused, none trained on
        assert result.stderr.count("refused a reply from") == served
        print(f"hostile replies served and refused: {served}")
    finally:
        terminate_process_group_blocking(hostile, grace=10)  # type: ignore[arg-type]
        if hostile.stdout is not None:
            hostile.stdout.close()


async def test_through_a_hostile_router_each_refused_reply_is_resent_then_named() -> None:
    async with anyio.create_task_group() as group, EngineClient(max_connections=2, retry=NO_RETRY) as client:
        client.set_vocab_size(1000)
        router = await group.start(HostileEngine("oov").run)
        dispatcher = Dispatcher(client=client, pool=None, router_url=router.url, max_attempts=3)
        with pytest.raises(NoEngineAvailable, match=rf"router at {router.url} gave 3 refused replies"):
            await dispatcher.generate({"input_ids": [1], "sampling_params": {"max_new_tokens": 2}})
        assert (router.generated, dict(dispatcher.refused)) == (3, {router.url: 3})
        group.cancel_scope.cancel()


@pytest.mark.parametrize("fleet_with", ["deep_error"], indirect=True)
async def test_an_engine_failing_every_request_but_answering_probes_costs_retries_not_the_run(
        fleet_with: tuple[Dispatcher, HostileEngine], real_engine: str) -> None:
    dispatcher, hostile = fleet_with
    (handle,) = [h for h in dispatcher.pool.alive() if h.url == hostile.url]  # type: ignore[union-attr]
    _, url = await dispatcher.generate(dict(PAYLOAD), engine=handle)
    assert (url, hostile.generated, dict(dispatcher.refused)) == (real_engine, 1, {hostile.url: 1})
    # still in the fleet (it answers its probe), but kept out of picks: the next request is the real engine's
    assert hostile.url in [h.url for h in dispatcher.pool.alive()]  # type: ignore[union-attr]
    _, url = await dispatcher.generate(dict(PAYLOAD))
    assert (url, hostile.generated) == (real_engine, 1)


@pytest.mark.parametrize("mode", STALL_MODES)
async def test_a_stalled_engine_costs_its_bound_and_the_request_is_answered_elsewhere(
        mode: str, real_engine: str, tiny_model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Issue 37's drills on the dispatch path (the fake's `drip` and `wedge`): the engine client ends the request
    as stalled within its bound (1 s here; the read timeout is an hour), and the dispatch sends it to the real
    engine — a dripping engine that answers its probe is kept out of picks, a wedged one is marked dead. `hold`
    answers /health but never the generate: its request's generation bound (1 s + 64 tokens × 0.1 s) ends it."""
    async with anyio.create_task_group() as group, EngineClient(max_connections=8, retry=NO_RETRY, stall_timeout=1.0,
                                                                probe_timeout=1.0, token_timeout=0.1) as client:
        await group.start(client.watch_stalls)
        client.set_vocab_size(AutoConfig.from_pretrained(tiny_model_dir).vocab_size)
        hostile = await group.start(HostileEngine(mode).run)
        addrs = [real_engine.removeprefix("http://"), hostile.url.removeprefix("http://")]
        fleet = EngineFleet(client=client, external_urls=addrs, run_dir=tmp_path, group="stall", probe_timeout=2.0)
        await group.start(fleet.run)
        dispatcher = Dispatcher(client=client, pool=fleet, watch_engine_state=False)
        (handle,) = [h for h in fleet.alive() if h.url == hostile.url]
        with caplog.at_level(logging.WARNING, logger="coordinator.rollout.dispatch"), anyio.fail_after(60):
            answer, url = await dispatcher.generate(dict(PAYLOAD), engine=handle)
        assert url == real_engine and hostile.generated == 1 and len(answer.replies) == 2
        (warning,) = [r.getMessage() for r in caplog.records
                      if r.name == "coordinator.rollout.dispatch" and hostile.url in r.getMessage()]
        if mode == "hold":
            assert f"engine {hostile.url}/generate stalled: POST /generate made no progress for 7.4 s (no answer " \
                   "within 7.4 s, the bound of its request: 1 s + 64 new tokens × 0.1 s" in warning
            assert "answers its probe" in warning and handle.alive and hostile.held == 1
            group.cancel_scope.cancel()
            return
        assert f"engine {hostile.url}/generate stalled: POST /generate made no progress for 1 s" in warning
        if mode == "drip":
            assert "a reply dripping" in warning and "answers its probe" in warning and handle.alive
        else:
            assert "/health gave none within 1 s" in warning and "died during a request" in warning
            assert not handle.alive
        group.cancel_scope.cancel()


class ModelAsSnapshot:
    """Stand-in for the TrainGroup's `export_weights` (the ranks are not what these drills are about): the
    snapshot every engine loads is the tiny model itself, which the real engine serves already."""

    def __init__(self, model_dir: Path) -> None:
        self.model_dir = model_dir

    async def export_weights(self, directory: Path, weight_version: str, keep: int = 2) -> Path:
        return self.model_dir


async def test_an_engine_that_never_acknowledges_a_weight_load_is_named_within_the_deadline(
        real_engine: str, tiny_model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Issue 37's drill "a resume where one engine never finishes loading the weights": the resume's engines
    take the checkpoint's weights through `WeightSync.update` (coordinator/loop.py `_resume`), driven here
    directly with the fake's `noload` beside the real engine and a 1 s `--update-weight-ack-timeout`. Without
    rollout FT the update fails with one line naming the engine, the call and the time waited; with it, the
    engine is marked dead (its recovery loads the current weights) and the real engine serves the version."""
    import inspect

    from coordinator.weights.sync import WeightSync, WeightSyncError

    unacked_default_s = inspect.signature(WeightSync).parameters["ack_timeout_s"].default

    async with anyio.create_task_group() as group, EngineClient(max_connections=8, retry=NO_RETRY) as client:
        hostile = await group.start(HostileEngine("noload").run)
        fleet = EngineFleet(client=client, external_urls=[real_engine.removeprefix("http://"),
                                                          hostile.url.removeprefix("http://")],
                            run_dir=tmp_path, group="noload")
        await group.start(fleet.run)
        (handle,) = [h for h in fleet.alive() if h.url == hostile.url]
        for recover in (False, True):
            sync = WeightSync(mode="disk", fleet=fleet, client=client, trainer=ModelAsSnapshot(tiny_model_dir),  # type: ignore[arg-type]
                              snapshot_dir=tmp_path / "weights", recover_engines=recover, ack_timeout_s=1.0)
            started = anyio.current_time()
            with anyio.fail_after(60), caplog.at_level(logging.WARNING, logger="coordinator.weights.sync"):
                if recover:
                    await sync.update("2")
                else:
                    with pytest.raises(WeightSyncError) as failed:
                        await sync.update("1")
            elapsed = anyio.current_time() - started
            # the 1 s deadline, not the 600 s an acknowledgment may take by default: a twentieth of that tells
            # them apart on a loaded machine too (the real engine's load runs inside this wait)
            assert 1.0 <= elapsed < unacked_default_s / 20, elapsed
            overdue = (f"{handle.name}': 'engine {hostile.url}: POST /update_weights_from_disk not acknowledged "
                       "within 1 s (--update-weight-ack-timeout); 1.")
            if not recover:
                message = str(failed.value)
                assert "\n" not in message and overdue in message, message
                assert handle.alive
        assert not handle.alive and "marked dead" in caplog.text and "POST /update_weights_from_disk" in caplog.text
        assert await client.engine(real_engine).get_weight_version() == "2"
        assert hostile.held == 2
        group.cancel_scope.cancel()


async def test_with_only_an_engine_that_never_finishes_a_generate_the_request_ends_naming_it(tmp_path: Path) -> None:
    """No other engine to take the request (and no rollout FT to replace the engine): each attempt ends at the
    request's generation bound (1 s + 4 tokens × 0.1 s) and the request fails in one line naming the engine and
    the wait, after `max_attempts` bounds — never the hour's read timeout."""
    async with anyio.create_task_group() as group, EngineClient(max_connections=4, retry=NO_RETRY, stall_timeout=1.0,
                                                                probe_timeout=1.0, token_timeout=0.1) as client:
        await group.start(client.watch_stalls)
        hostile = await group.start(HostileEngine("hold").run)
        fleet = EngineFleet(client=client, external_urls=[hostile.url.removeprefix("http://")], run_dir=tmp_path,
                            group="held", probe_timeout=2.0)
        await group.start(fleet.run)
        dispatcher = Dispatcher(client=client, pool=fleet, watch_engine_state=False, max_attempts=2)
        started = anyio.current_time()
        with anyio.fail_after(60), pytest.raises(NoEngineAvailable) as failed:
            await dispatcher.generate({"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4}})
        elapsed = anyio.current_time() - started
        message = str(failed.value)
        assert "\n" not in message and "request failed on 2 engines in a row" in message, message
        assert f"the last: engine {hostile.url}/generate stalled: POST /generate made no progress for 1.4 s" in message
        assert hostile.held == 2 and 2 * 1.4 <= elapsed < 30, elapsed
        group.cancel_scope.cancel()
