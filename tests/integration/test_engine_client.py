"""The engine client against a real CPU engine (workers.engine) on 127.0.0.1, launched by our launcher.

Checks every typed method, that a 4xx raises at once with the server's message (one request on the wire,
counted with aiohttp's own request hook, `TraceConfig`), that 401 without the key is typed, and that a SIGKILLed engine turns
in-flight and later requests into EngineUnreachable without hanging.
"""

from __future__ import annotations

import os
import signal
from collections.abc import AsyncIterator
from contextlib import aclosing
from pathlib import Path
from typing import Any

import aiohttp
import anyio
import pytest

from coordinator.engines.client import EngineClient
from coordinator.engines.errors import EngineHTTPError, EngineTimeout, EngineUnreachable
from coordinator.engines.launch import EngineProcess
from coordinator.engines.policy import NO_RETRY, RetryPolicy
from coordinator.engines.spec import EngineLaunchSpec
from tests.support.waiting import wait_until

API_KEY = "test-key-123"
ENGINE_ENV = (("OMP_NUM_THREADS", "1"), ("MKL_NUM_THREADS", "1"))


def counted_requests() -> tuple[list[str], aiohttp.TraceConfig]:
    """The path of every request the client puts on the wire (retries included), and the hook that lists them."""
    sent: list[str] = []

    async def count(session: object, context: object, params: aiohttp.TraceRequestStartParams) -> None:
        sent.append(params.url.path)

    hook = aiohttp.TraceConfig()
    hook.on_request_start.append(count)
    return sent, hook


async def held(engine: Any) -> int:
    """Requests the engine holds now: queued (it is paused) or running."""
    state = (await engine.server_info())["internal_states"][0]
    return int(state["num_queue_reqs"]) + int(state["num_running_reqs"])


def cpu_spec(model_dir: Path, **kw: object) -> EngineLaunchSpec:
    return EngineLaunchSpec(kind="rayless", model_path=str(model_dir), env=ENGINE_ENV, start_timeout=120.0, **kw)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
async def keyed_engine(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[str]:
    """One engine with --api-key for the whole module (started once: engines take seconds to start)."""
    run_dir = tmp_path_factory.mktemp("client-run")
    async with EngineClient(max_connections=8) as probe_client:
        ep = EngineProcess(
            cpu_spec(tiny_model_dir, api_key=API_KEY),
            name="client",
            log_path=run_dir / "engine.log",
            client=probe_client,
        )
        try:
            yield await ep.start()
        finally:
            await ep.stop()


@pytest.fixture
async def client() -> AsyncIterator[EngineClient]:
    async with EngineClient(max_connections=16, api_key=API_KEY, read_timeout=60.0) as c:
        yield c


PROMPT = {"text": "abc", "sampling_params": {"max_new_tokens": 4, "temperature": 0.0}}


async def test_generate_single_returns_object(client: EngineClient, keyed_engine: str) -> None:
    answer = await client.engine(keyed_engine).generate(PROMPT)
    (out,) = answer.replies
    assert isinstance(out.text, str)
    assert len(out.output_ids) >= 1
    assert out.finish is not None and out.finish.type in ("length", "stop")


async def test_generate_batched_n_returns_list(client: EngineClient, keyed_engine: str) -> None:
    out = await client.engine(keyed_engine).generate(
        {"text": ["ab", "cd"], "sampling_params": {"max_new_tokens": 3, "n": 2}}
    )
    assert len(out.replies) == 4
    assert all(o.finish is not None and len(o.output_ids) >= 1 for o in out.replies)


async def test_generate_stream_yields_chunks_until_done(client: EngineClient, keyed_engine: str) -> None:
    payload = {
        "text": "abc",
        "sampling_params": {"max_new_tokens": 5, "temperature": 0.0, "ignore_eos": True},
    }
    async with aclosing(client.engine(keyed_engine).generate_stream(payload)) as stream:
        chunks = [c async for c in stream]
    assert chunks, "no chunk streamed"
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"
    full = await client.engine(keyed_engine).generate(payload)
    assert chunks[-1]["text"] == full.replies[0].text  # cumulative chunks end on the whole greedy text


async def test_info_and_health_endpoints(client: EngineClient, keyed_engine: str) -> None:
    e = client.engine(keyed_engine)
    await e.health()
    await e.health_generate()
    info = await e.model_info()
    assert "model_path" in info and "weight_version" in info
    server = await e.server_info()
    assert isinstance(server, dict) and server
    assert isinstance(await e.get_weight_version(), str)
    assert "sglang:" in await e.metrics()


async def test_weight_version_and_control_endpoints(client: EngineClient, keyed_engine: str) -> None:
    e = client.engine(keyed_engine)
    out = await e.update_weight_version("v-test-7")
    assert out.get("success") is True
    assert await e.get_weight_version() == "v-test-7"
    assert (await e.model_info())["weight_version"] == "v-test-7"
    await e.flush_cache()
    await e.abort_request("no-such-rid")  # unknown rid is a no-op
    await e.abort_request(abort_all=True)
    await e.pause_generation("abort")
    await e.continue_generation()
    await e.pause_generation("in_place")
    await e.continue_generation()
    await e.release_memory_occupation()
    await e.resume_memory_occupation()
    assert len((await e.generate(PROMPT)).replies) == 1  # still serving after all of the above
    with pytest.raises(ValueError, match="rid or abort_all"):
        await e.abort_request()
    with pytest.raises(ValueError, match="pause mode"):
        await e.pause_generation("bogus")


async def test_update_weights_from_disk(
    client: EngineClient, keyed_engine: str, tiny_model_dir: Path
) -> None:
    e = client.engine(keyed_engine)
    out = await e.update_weights_from_disk(str(tiny_model_dir), weight_version="disk-1")
    assert out["success"] is True
    assert await e.get_weight_version() == "disk-1"
    with pytest.raises(EngineHTTPError) as err:
        await e.update_weights_from_disk("/nonexistent/snapshot", weight_version="disk-2")
    assert err.value.status == 400
    assert await e.get_weight_version() == "disk-1"  # failed update keeps the old weights and version


async def test_4xx_raises_at_once_with_server_message(keyed_engine: str) -> None:
    sent, hook = counted_requests()
    # A generous retry policy: a 4xx must still be sent exactly once.
    policy = RetryPolicy(attempts=5, backoff=0.01, budget=30.0)
    async with EngineClient(max_connections=4, api_key=API_KEY, retry=policy, trace_configs=[hook]) as c:
        with pytest.raises(EngineHTTPError) as err:
            await c.engine(keyed_engine).generate({"text": "", "sampling_params": {"max_new_tokens": 2}})
    assert err.value.status == 400
    assert err.value.server_message  # the engine's own message, not a generic one
    assert err.value.server_message in str(err.value)
    assert sent == ["/generate"]


async def test_5xx_is_retried_within_policy(keyed_engine: str) -> None:
    """An unknown sampling key: real SGLang answers a plain-text 500 (the CPU engine too, or a 400)."""
    sent, hook = counted_requests()
    policy = RetryPolicy(attempts=3, backoff=0.01, budget=30.0)
    async with EngineClient(max_connections=4, api_key=API_KEY, retry=policy, trace_configs=[hook]) as c:
        with pytest.raises(EngineHTTPError) as err:
            await c.engine(keyed_engine).generate({"text": "ab", "sampling_params": {"no_such_key": 1}})
    assert err.value.server_message
    assert len(sent) == (3 if err.value.status >= 500 else 1)


async def test_missing_api_key_is_401(keyed_engine: str) -> None:
    async with EngineClient(max_connections=2) as c:
        await c.engine(keyed_engine).health()  # /health* needs no key
        with pytest.raises(EngineHTTPError) as err:
            await c.engine(keyed_engine).model_info()
    assert err.value.status == 401


async def test_read_timeout_is_typed(client: EngineClient, keyed_engine: str) -> None:
    e = client.engine(keyed_engine)
    await e.pause_generation("in_place")  # a paused engine holds new generates: the answer cannot come
    try:
        with pytest.raises(EngineTimeout):
            await e.generate(PROMPT, timeout=0.3, retry=NO_RETRY)
    finally:
        await e.continue_generation()
    await e.abort_request(abort_all=True)  # do not leave the held request running for the next tests


async def test_refused_connection_is_unreachable() -> None:
    from coordinator.engines.spec import free_port

    async with EngineClient(max_connections=2, retry=RetryPolicy(attempts=2, backoff=0.01)) as c:
        with pytest.raises(EngineUnreachable) as err:
            await c.engine(f"http://127.0.0.1:{free_port()}").health()
    assert "unreachable" in str(err.value)


async def test_killed_engine_raises_unreachable_and_nothing_hangs(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    async with EngineClient(max_connections=32, retry=RetryPolicy(attempts=2, backoff=0.05)) as c:
        ep = EngineProcess(
            cpu_spec(tiny_model_dir), name="victim", log_path=tmp_path / "victim.log", client=c
        )
        url = await ep.start()
        try:
            e = c.engine(url)
            errors: list[BaseException] = []
            payload = {"text": "abc", "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}}
            await e.pause_generation("in_place")  # held by the engine: all 8 are in flight when it dies

            async def one() -> None:
                try:
                    await e.generate(payload)
                except Exception as exc:
                    errors.append(exc)

            with anyio.fail_after(60):  # "nothing hangs": a hang fails the test instead of the suite
                async with anyio.create_task_group() as tg:
                    for _ in range(8):
                        tg.start_soon(one)
                    await wait_until(lambda: held(e), until=lambda n: n == 8, timeout=30,
                                     what="the 8 requests held by the paused engine (its /server_info)")
                    assert ep.pid is not None
                    os.killpg(ep.pid, signal.SIGKILL)
            assert len(errors) == 8
            assert all(isinstance(x, EngineUnreachable) for x in errors), errors
            assert all(x.url == url + "/generate" for x in errors)
            with pytest.raises(EngineUnreachable):
                await e.health_generate(retry=NO_RETRY)
        finally:
            await ep.stop()
        assert ep.exit_code() == -signal.SIGKILL


async def test_distributed_weight_update_methods(
    client: EngineClient, keyed_engine: str, tiny_model_dir: Path
) -> None:
    """init / begin / update_weights_from_distributed (flattened) / end / destroy through the typed methods;
    this process plays the trainer's rank 0 over gloo with the rank side's group and bucket helpers."""
    import torch
    from transformers import AutoModelForCausalLM

    from coordinator.engines.spec import free_port
    from workers.shared_torch.weight_group import flatten_bucket, join_weight_update_group, send

    e = client.engine(keyed_engine)
    greedy = {
        "input_ids": [5, 6, 7],
        "sampling_params": {"max_new_tokens": 6, "temperature": 0.0},
        "return_logprob": True,
    }
    before = await e.generate(greedy)
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    torch.manual_seed(0)
    named = [
        (name, (p.detach() + 0.5 * torch.randn_like(p)).contiguous()) for name, p in model.named_parameters()
    ]
    port = free_port()
    results: dict[str, dict[str, object]] = {}

    async def init() -> None:
        results["init"] = await e.init_weights_update_group(
            master_address="127.0.0.1",
            master_port=port,
            rank_offset=1,
            world_size=2,
            group_name="g1",
            backend="gloo",
        )

    async with anyio.create_task_group() as tg:
        tg.start_soon(init)
        group = await anyio.to_thread.run_sync(
            lambda: join_weight_update_group(
                master_address="127.0.0.1",
                master_port=port,
                rank=0,
                world_size=2,
                group_name="g1",
                timeout_s=60,
            )
        )
    try:
        assert results["init"]["success"] is True
        assert await e.begin_weight_update() is True
        with pytest.raises(EngineHTTPError, match="already open"):
            await e.begin_weight_update()

        async def update() -> None:
            results["update"] = await e.update_weights_from_distributed(
                names=[n for n, _ in named],
                dtypes=["float32"] * len(named),
                shapes=[list(t.shape) for _, t in named],
                group_name="g1",
                weight_version="dist-1",
                load_format="flattened_bucket",
            )

        def send_bucket() -> None:
            for work in send(group, [flatten_bucket([t for _, t in named])]):
                work.wait()

        async with anyio.create_task_group() as tg:
            tg.start_soon(update)
            await anyio.to_thread.run_sync(send_bucket)
        assert (await e.end_weight_update())["success"] is True
    finally:
        group.close()
    assert results["update"]["success"] is True
    assert await e.get_weight_version() == "dist-1"
    after = await e.generate(greedy)
    assert after.replies[0].logprobs != before.replies[0].logprobs
    assert (await e.destroy_weights_update_group("g1"))["success"] is True
    with pytest.raises(EngineHTTPError) as err:  # a second destroy: the group is gone, a 400 at once
        await e.destroy_weights_update_group("g1")
    assert err.value.status == 400
    with pytest.raises(ValueError, match="lengths differ"):
        await e.update_weights_from_distributed(names=["a"], dtypes=[], shapes=[[1]])

    await e.update_weights_from_disk(
        str(tiny_model_dir), weight_version="restored"
    )  # leave it as we found it
    assert (await e.generate(greedy)).replies[0].logprobs == before.replies[0].logprobs
