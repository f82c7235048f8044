"""The SGLang HTTP contract (docs/engine.md), checked against a real CPU engine process.

Every test takes the engine's base URL from the `engine_url` fixture. The checks that hold at any front live
in `tests.support.generate_contract` and are collected here too (and against sglang-router in
`test_router_contract.py`); the ones below are the engine's own. Tests that need the model itself (logprob
checks) load it from `tiny_model_dir` in this process.
"""

# The shared fixtures `client` and `reference_model` are imported below, then named as test parameters.
# ruff: noqa: F811
from __future__ import annotations

import json
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from tests.support.engine_proc import start_engine
from tests.support.generate_contract import (  # noqa: F401 - the shared checks, collected here against the engine
    PROMPT,
    client,
    generate,
    greedy,
    reference_logprobs,
    reference_model,
    stream_chunks,
    test_filters_that_keep_one_token_equal_greedy,
    test_finish_stop_on_string_trims_unless_no_stop_trim,
    test_finish_stop_on_token_id,
    test_min_new_tokens_bans_stop_tokens,
    test_output_logprobs_are_log_softmax_of_raw_logits,
    test_sampling_seed_is_deterministic,
    test_single_text_response_shape,
    test_streaming_is_cumulative_and_ends_with_done,
    test_top_logprobs,
)
from tests.support.waiting import wait_until


@pytest.fixture(scope="module")
def engine_url(tiny_model_dir: Path) -> Iterator[str]:
    with start_engine(tiny_model_dir) as url:
        yield url


# ---- /generate shapes ----------------------------------------------------------------------------------


async def test_rid_becomes_id_and_unknown_top_level_keys_are_ignored(client: httpx.AsyncClient) -> None:
    out = await generate(
        client, {"text": PROMPT, "rid": "my-rid", "no_such_key": 1, "sampling_params": greedy(2)}
    )
    assert out["meta_info"]["id"] == "my-rid"


async def test_batched_text_with_n_is_prompt_by_prompt(client: httpx.AsyncClient) -> None:
    prompts = ["12", "abcd"]
    out = await generate(
        client, {"text": prompts, "sampling_params": {"max_new_tokens": 3, "n": 3, "ignore_eos": True}}
    )
    assert isinstance(out, list) and len(out) == 6
    assert [o["meta_info"]["prompt_tokens"] for o in out] == [2, 2, 2, 4, 4, 4]
    assert len({o["meta_info"]["id"] for o in out}) == 6
    assert all(len(o["output_ids"]) == 3 for o in out)


async def test_batched_input_ids_and_per_item_params(client: httpx.AsyncClient) -> None:
    out = await generate(
        client,
        {"input_ids": [[6, 7, 8], [9, 10]], "sampling_params": [greedy(2), greedy(4)]},
    )
    assert [o["meta_info"]["completion_tokens"] for o in out] == [2, 4]
    single = await generate(client, {"input_ids": [6, 7, 8], "sampling_params": greedy(2)})
    assert single["output_ids"] == out[0]["output_ids"]
    # A one-item batch is still a batch: the answer is an array.
    assert isinstance(await generate(client, {"text": ["12"], "sampling_params": greedy(1)}), list)


async def test_abort_by_rid_returns_partial_output(client: httpx.AsyncClient) -> None:
    body = {
        "text": PROMPT,
        "rid": "to-abort",
        "stream": True,
        "sampling_params": greedy(400, ignore_eos=True),
    }
    chunks: list[Any] = []
    async with client.stream("POST", "/generate", json=body) as response:
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            payload = line.removeprefix("data: ")
            chunks.append(payload if payload == "[DONE]" else json.loads(payload))
            if len(chunks) == 1:
                aborted = await client.post("/abort_request", json={"rid": "to-abort"})
                assert aborted.status_code == 200
    assert chunks[-1] == "[DONE]"
    final = chunks[-2]
    assert final["meta_info"]["finish_reason"]["type"] == "abort"
    assert "message" in final["meta_info"]["finish_reason"]
    assert 1 <= len(final["output_ids"]) < 400
    # An unknown rid is a no-op.
    assert (await client.post("/abort_request", json={"rid": "nobody"})).status_code == 200


async def test_streaming_batch_carries_index(client: httpx.AsyncClient) -> None:
    chunks = await stream_chunks(client, {"text": ["12", "34"], "sampling_params": greedy(3, n=2)})
    finals = {c["index"]: c for c in chunks[:-1] if c["meta_info"]["finish_reason"] is not None}
    assert sorted(finals) == [0, 1, 2, 3]


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"text": ""}, "empty"),
        ({"input_ids": []}, "empty"),
        ({}, "exactly one"),
        ({"text": "1", "input_ids": [1]}, "exactly one"),
        ({"input_ids": [1, 10_000]}, "vocabulary"),
        ({"text": "1" * 500, "sampling_params": {"max_new_tokens": 100}}, "context length"),
        ({"text": "1", "sampling_params": {"temperature": -1}}, "temperature"),
        ({"text": "1", "sampling_params": {"top_p": 0}}, "top_p"),
        ({"text": "1", "sampling_params": {"top_p": 1.5}}, "top_p"),
        ({"text": "1", "sampling_params": {"top_k": 0}}, "top_k"),
        ({"text": "1", "sampling_params": {"min_p": 2}}, "min_p"),
        ({"text": "1", "sampling_params": {"max_new_tokens": -1}}, "max_new_tokens"),
        ({"text": "1", "sampling_params": {"n": 0}}, "n must"),
        ({"text": "1", "sampling_params": {"temperature": "hot"}}, "temperature"),
        ({"text": "1", "sampling_params": {"bogus_key": 1}}, "bogus_key"),
        ({"text": ["1", "2"], "sampling_params": [{}]}, "sampling_params"),
        ({"text": "1", "token_ids_logprob": [1, 10_000]}, "token_ids_logprob"),
        ({"text": ["1", "2"], "token_ids_logprob": [[1]]}, "token_ids_logprob"),
        ({"input_ids": [1, 2], "token_ids_logprob_positions": [[1]]}, "one per input position"),
    ],
)
async def test_rejected_input_is_400_with_message(client: httpx.AsyncClient, body: dict, needle: str) -> None:
    out = await generate(client, body, status=400)
    assert needle in out["error"]["message"]


async def test_invalid_json_is_400(client: httpx.AsyncClient) -> None:
    response = await client.post("/generate", content=b"{not json")
    assert response.status_code == 400
    assert "JSON" in response.json()["error"]["message"]


# ---- sampling and logprobs ------------------------------------------------------------------------------


async def test_prefill_only_scores_the_prompt(client: httpx.AsyncClient, reference_model: Any) -> None:
    body = {
        "text": ["12+3", "ab"],
        "return_logprob": True,
        "return_text_in_logprobs": True,
        "logprob_start_len": 0,
        "sampling_params": {"max_new_tokens": 0},
    }
    out = await generate(client, body)
    first = out[0]
    assert first["output_ids"] == [] and first["meta_info"]["completion_tokens"] == 0
    assert first["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    assert first["meta_info"]["prompt_tokens"] == 4
    entries = first["meta_info"]["input_token_logprobs"]
    assert [e[2] for e in entries] == list("12+3")
    reference = reference_logprobs(reference_model, [e[1] for e in entries])
    assert [e[0] for e in entries[1:]] == pytest.approx(
        [reference[i - 1, entries[i][1]].item() for i in range(1, 4)], abs=1e-4
    )
    # The default logprob_start_len (-1) returns only the last prompt position.
    default = await generate(
        client, {"text": "12+3", "return_logprob": True, "sampling_params": {"max_new_tokens": 0}}
    )
    assert len(default["meta_info"]["input_token_logprobs"]) == 1
    assert default["meta_info"]["input_token_logprobs"][0][0] == pytest.approx(entries[-1][0], abs=1e-5)


async def test_token_ids_logprob_scores_the_asked_ids_at_every_position(
        client: httpx.AsyncClient, reference_model: Any) -> None:
    """SGLang's `token_ids_logprob` (what miles' top-k OPD asks a teacher for): the logprob of each asked id, in
    the asked order, at every input position from `logprob_start_len` (position 0 empty) and every output one."""
    ids = [5, 2, 9]
    body = {"text": "12+3", "return_logprob": True, "logprob_start_len": 0, "token_ids_logprob": ids,
            "top_logprobs_num": 2, "sampling_params": {"max_new_tokens": 3, "ignore_eos": True, "sampling_seed": 1}}
    out = await generate(client, body)
    meta = out["meta_info"]
    prompt = [entry[1] for entry in meta["input_token_logprobs"]]
    reference = reference_logprobs(reference_model, prompt + out["output_ids"])
    inputs = meta["input_token_ids_logprobs"]
    assert len(inputs) == len(prompt) and inputs[0] == []
    for position, entry in enumerate(inputs[1:], start=1):
        assert [e[1] for e in entry] == ids
        assert [e[0] for e in entry] == pytest.approx([reference[position - 1, i].item() for i in ids], abs=1e-4)
    outputs = meta["output_token_ids_logprobs"]
    assert len(outputs) == 3
    for step, entry in enumerate(outputs):
        row = len(prompt) - 1 + step
        assert [e[0] for e in entry] == pytest.approx([reference[row, i].item() for i in ids], abs=1e-4)
    tops = meta["input_top_logprobs"][1:]  # the asked ids do not change the top-k beside them
    assert all(len(entry) == 2 for entry in tops)
    # Prefill only (how a teacher is scored): the same input top-k and asked ids as with generation.
    scored = await generate(client, {**body, "sampling_params": {"max_new_tokens": 0}})
    assert scored["meta_info"]["input_top_logprobs"] == meta["input_top_logprobs"]
    assert scored["meta_info"]["input_token_ids_logprobs"] == inputs
    # miles' per-position form: each input position (from 0) its own ids.
    per_position = [[], [3], [], [7, 1]]
    rows = await generate(client, {"text": "12+3", "return_logprob": True, "logprob_start_len": 0,
                                   "token_ids_logprob_positions": per_position,
                                   "sampling_params": {"max_new_tokens": 0}})
    got = rows["meta_info"]["input_token_ids_logprobs"]
    assert [[e[1] for e in entry] for entry in got] == per_position
    for position, entry in enumerate(got[1:], start=1):
        assert [e[0] for e in entry] == pytest.approx(
            [reference[position - 1, i].item() for i in per_position[position]], abs=1e-4)
    # Without the field, no such key (as SGLang leaves it unset).
    plain = await generate(client, {"text": "12+3", "return_logprob": True, "sampling_params": {"max_new_tokens": 0}})
    assert "input_token_ids_logprobs" not in plain["meta_info"]


async def test_concurrent_requests_match_their_solo_runs(client: httpx.AsyncClient) -> None:
    prompts = ["1", "22 3", "abc=", "9 8 7 6 5", "x", "hello", "0+0=", "Q"]

    def body(prompt: str, length: int) -> dict[str, Any]:
        return {"text": prompt, "return_logprob": True, "sampling_params": greedy(length, ignore_eos=True)}

    solo = [await generate(client, body(p, 6 + i)) for i, p in enumerate(prompts)]
    together: list[Any] = [None] * len(prompts)

    async def run(i: int) -> None:
        together[i] = await generate(client, body(prompts[i], 6 + i))

    async with anyio.create_task_group() as tg:
        for i in range(len(prompts)):
            tg.start_soon(run, i)
    for alone, batched in zip(solo, together, strict=True):
        assert batched["output_ids"] == alone["output_ids"]
        lp_alone = [e[0] for e in alone["meta_info"]["output_token_logprobs"]]
        lp_batched = [e[0] for e in batched["meta_info"]["output_token_logprobs"]]
        assert lp_batched == pytest.approx(lp_alone, abs=1e-5)


# ---- health, info, control ------------------------------------------------------------------------------


async def test_health_and_info_endpoints(client: httpx.AsyncClient, tiny_model_dir: Path) -> None:
    assert (await client.get("/health")).status_code == 200
    assert (await client.get("/health_generate")).status_code == 200
    for path in ("/model_info", "/get_model_info"):
        info = (await client.get(path)).json()
        assert info["model_path"] == str(tiny_model_dir)
        assert info["tokenizer_path"] == str(tiny_model_dir)
        assert info["is_generation"] is True and info["weight_version"] == "default"
    for path in ("/server_info", "/get_server_info"):
        info = (await client.get(path)).json()
        assert info["max_total_num_tokens"] > 0 and "version" in info and "internal_states" in info
        assert "api_key" not in info
    for path in ("/get_weight_version", "/weight_version"):
        assert (await client.get(path)).json() == {"weight_version": "default"}


async def test_metrics_are_prometheus_text(client: httpx.AsyncClient) -> None:
    await generate(client, {"text": PROMPT, "sampling_params": greedy(2)})
    text = (await client.get("/metrics")).text
    for name in (
        "sglang:num_running_reqs",
        "sglang:num_queue_reqs",
        "sglang:gen_throughput",
        "sglang:prompt_tokens_total",
        "sglang:generation_tokens_total",
    ):
        assert f"# TYPE {name} " in text
    total = next(line for line in text.splitlines() if line.startswith("sglang:generation_tokens_total"))
    assert float(total.rsplit(" ", 1)[1]) >= 2


async def test_update_weight_version(client: httpx.AsyncClient) -> None:
    try:
        out = (await client.post("/update_weight_version", json={"new_version": "v7"})).json()
        assert out == {"success": True, "message": out["message"], "new_version": "v7"}
        assert (await client.get("/get_weight_version")).json() == {"weight_version": "v7"}
        gen = await generate(client, {"text": PROMPT, "sampling_params": greedy(1)})
        assert gen["meta_info"]["weight_version"] == "v7"
        assert (await client.post("/update_weight_version", json={})).status_code == 400
    finally:
        await client.post("/update_weight_version", json={"new_version": "default"})


async def running_stream(
    client: httpx.AsyncClient, body: dict[str, Any], started: anyio.Event, sink: list
) -> None:
    """Stream a generation into `sink`, setting `started` after its first chunk."""
    async with client.stream("POST", "/generate", json={**body, "stream": True}) as response:
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                sink.append(json.loads(line.removeprefix("data: ")))
                started.set()


async def held_requests(client: httpx.AsyncClient) -> int:
    """Requests the engine holds now, queued or running (its /server_info)."""
    state = (await client.get("/server_info")).json()["internal_states"][0]
    return int(state["num_queue_reqs"]) + int(state["num_running_reqs"])


async def generated_total(client: httpx.AsyncClient) -> float:
    text = (await client.get("/metrics")).text
    line = next(line for line in text.splitlines() if line.startswith("sglang:generation_tokens_total"))
    return float(line.rsplit(" ", 1)[1])


async def test_flush_cache_refuses_while_running(client: httpx.AsyncClient) -> None:
    assert (await client.post("/flush_cache")).status_code == 200
    started, sink = anyio.Event(), []
    async with anyio.create_task_group() as tg:
        tg.start_soon(
            running_stream,
            client,
            {"text": PROMPT, "rid": "long", "sampling_params": greedy(400, ignore_eos=True)},
            started,
            sink,
        )
        await started.wait()
        assert (await client.get("/flush_cache")).status_code == 400
        await client.post("/abort_request", json={"abort_all": True})
    assert sink[-1]["meta_info"]["finish_reason"]["type"] == "abort"


@pytest.mark.parametrize("mode", ["in_place", "retract"])
async def test_pause_holds_generation_and_continue_finishes_it(client: httpx.AsyncClient, mode: str) -> None:
    # long enough that the stream is still running when the pause lands, however loaded the machine (60 tokens
    # of the tiny model could finish between the first chunk and the pause on two busy cores)
    params = greedy(400, ignore_eos=True)
    expected = await generate(client, {"text": PROMPT, "sampling_params": params})
    started, sink = anyio.Event(), []
    held: list[Any] = []

    async def new_request() -> None:
        held.append(await generate(client, {"text": "12", "sampling_params": greedy(3)}))

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(running_stream, client, {"text": PROMPT, "sampling_params": params}, started, sink)
            await started.wait()
            paused = await client.post("/pause_generation", json={"mode": mode})
            assert paused.status_code == 200
            assert "finish_reason" not in sink[-1]["meta_info"] or sink[-1]["meta_info"]["finish_reason"] is None
            tg.start_soon(new_request)
            await wait_until(lambda: held_requests(client), until=lambda n: n == 2, timeout=30,
                             what="the new request held by the paused engine beside the paused one")
            before = await generated_total(client)
            assert (await client.get("/health_generate")).status_code == 200  # probes still answer
            # The probe ran one scheduler step and generated its one token; the held requests advanced none.
            assert await generated_total(client) == before + 1  # nothing advances while paused
            assert held == []
            assert (await client.post("/continue_generation", json={})).status_code == 200
    finally:  # a failure above must not leave the module's engine paused for the tests after it
        await client.post("/continue_generation", json={})
    final = sink[-1]
    assert final["meta_info"]["finish_reason"] == {"type": "length", "length": 400}
    # Paused in place or retracted and re-prefilled, the greedy continuation is the same.
    assert final["output_ids"] == expected["output_ids"]
    assert held[0]["meta_info"]["finish_reason"]["type"] == "length"


async def test_pause_abort_mode_aborts_running_requests(client: httpx.AsyncClient) -> None:
    started, sink = anyio.Event(), []
    async with anyio.create_task_group() as tg:
        tg.start_soon(
            running_stream,
            client,
            {"text": PROMPT, "sampling_params": greedy(400, ignore_eos=True)},
            started,
            sink,
        )
        await started.wait()
        assert (await client.post("/pause_generation", json={"mode": "abort"})).status_code == 200
    try:
        assert sink[-1]["meta_info"]["finish_reason"]["type"] == "abort"
        assert (await client.post("/pause_generation", json={"mode": "sideways"})).status_code == 400
    finally:
        await client.post("/continue_generation", json={})
    assert (await generate(client, {"text": PROMPT, "sampling_params": greedy(1)}))["output_ids"]


async def test_release_and_resume_memory(client: httpx.AsyncClient) -> None:
    released = await client.post("/release_memory_occupation", json={})
    assert released.status_code == 200
    try:
        refused = await generate(client, {"text": PROMPT, "sampling_params": greedy(1)}, status=503)
        assert "resume_memory_occupation" in refused["error"]["message"]
        assert refused["error"]["type"] == "MemoryReleased"
        probe = await client.get("/health_generate")
        assert probe.status_code == 503 and probe.json()["error"]["type"] == "MemoryReleased"
        assert (await client.get("/health")).status_code == 200  # alive, only released
    finally:
        assert (await client.post("/resume_memory_occupation", json={})).status_code == 200
    assert (await generate(client, {"text": PROMPT, "sampling_params": greedy(1)}))["output_ids"]
    started, sink = anyio.Event(), []
    async with anyio.create_task_group() as tg:
        tg.start_soon(
            running_stream,
            client,
            {"text": PROMPT, "sampling_params": greedy(400, ignore_eos=True)},
            started,
            sink,
        )
        await started.wait()
        busy = await client.post("/release_memory_occupation", json={"tags": ["kv_cache"]})
        assert busy.status_code == 400
        await client.post("/abort_request", json={"abort_all": True})


# ---- auth ---------------------------------------------------------------------------------------------


async def test_api_key_guards_everything_but_health_and_metrics(tiny_model_dir: Path) -> None:
    with start_engine(tiny_model_dir, api_key="sekret") as url:
        async with httpx.AsyncClient(base_url=url, timeout=30.0) as http:
            body = {"text": PROMPT, "sampling_params": greedy(1)}
            denied = await http.post("/generate", json=body)
            assert denied.status_code == 401 and denied.json() == {"error": "Unauthorized"}
            wrong = await http.get("/model_info", headers={"Authorization": "Bearer nope"})
            assert wrong.status_code == 401
            ok = await http.post("/generate", json=body, headers={"Authorization": "Bearer sekret"})
            assert ok.status_code == 200
            for path in ("/health", "/health_generate", "/metrics"):
                assert (await http.get(path)).status_code == 200


async def metric(client: httpx.AsyncClient, name: str) -> float:
    text = (await client.get("/metrics")).text
    line = next(line for line in text.splitlines() if line.startswith(f"sglang:{name}{{"))
    return float(line.rsplit(" ", 1)[1])


async def test_client_disconnect_aborts_the_generation(client: httpx.AsyncClient, engine_url: str) -> None:
    body = {"text": PROMPT, "sampling_params": greedy(450, ignore_eos=True)}
    before = await metric(client, "generation_tokens_total")
    async with httpx.AsyncClient(base_url=engine_url, timeout=60.0) as doomed:
        async with anyio.create_task_group() as tg:
            tg.start_soon(partial(doomed.post, "/generate", json=body))
            await wait_until(lambda: metric(client, "num_running_reqs"), until=lambda n: n >= 1, timeout=30,
                             what="the request running")
            assert (await client.get("/health")).status_code == 200  # HTTP answers while generating
            tg.cancel_scope.cancel()  # closes the connection mid-request
    await wait_until(lambda: metric(client, "num_running_reqs"), until=lambda n: n == 0, timeout=30,
                     what="the disconnected request aborted")
    # It was aborted, not run to the end.
    assert await metric(client, "generation_tokens_total") - before < 450
