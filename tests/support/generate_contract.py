"""The /generate contract checks that hold at any SGLang front: a CPU engine directly, or sglang-router in
front of engines (docs/engine.md).

Owns those checks, their `client` fixture and request helpers, so that `test_engine_contract.py` and
`test_router_contract.py` both run them without one test module importing the other. A test module that
imports them supplies the `engine_url` fixture (module scope) they are run against; pytest collects the
imported `test_*` functions there. Tests that need the model itself (logprob checks) load it from
`tiny_model_dir` in the test process.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

PROMPT = "1 2 3="


@pytest.fixture
async def client(engine_url: str) -> Any:
    async with httpx.AsyncClient(base_url=engine_url, timeout=60.0) as http:
        yield http


async def generate(client: httpx.AsyncClient, body: dict[str, Any], status: int = 200) -> Any:
    response = await client.post("/generate", json=body)
    assert response.status_code == status, response.text
    return response.json()


def greedy(max_new_tokens: int = 8, **extra: Any) -> dict[str, Any]:
    return {"temperature": 0, "max_new_tokens": max_new_tokens, **extra}


async def stream_chunks(client: httpx.AsyncClient, body: dict[str, Any]) -> list[Any]:
    chunks: list[Any] = []
    async with client.stream("POST", "/generate", json={**body, "stream": True}) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                payload = line.removeprefix("data: ")
                chunks.append(payload if payload == "[DONE]" else json.loads(payload))
    return chunks


async def test_single_text_response_shape(client: httpx.AsyncClient) -> None:
    out = await generate(client, {"text": PROMPT, "sampling_params": greedy(6, ignore_eos=True)})
    assert isinstance(out, dict)
    assert set(out) >= {"text", "output_ids", "meta_info"}
    meta = out["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 6}
    assert len(out["output_ids"]) == meta["completion_tokens"] == 6
    assert meta["prompt_tokens"] == len(PROMPT)
    assert meta["cached_tokens"] == 0
    assert meta["weight_version"] == "default"
    assert meta["e2e_latency"] > 0 and isinstance(meta["id"], str) and meta["id"]
    assert "output_token_logprobs" not in meta


async def test_finish_stop_on_token_id(client: httpx.AsyncClient) -> None:
    base = await generate(client, {"text": PROMPT, "sampling_params": greedy(8)})
    first = base["output_ids"][0]
    out = await generate(client, {"text": PROMPT, "sampling_params": greedy(8, stop_token_ids=[first])})
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": first}
    assert out["output_ids"] == [first]  # the stop token is part of output_ids ...
    assert out["meta_info"]["completion_tokens"] == 1
    assert out["text"] == ""  # ... but trimmed from the text
    kept = await generate(
        client, {"text": PROMPT, "sampling_params": greedy(8, stop_token_ids=[first], no_stop_trim=True)}
    )
    assert kept["text"] == base["text"][:1]
    ignored = await generate(
        client, {"text": PROMPT, "sampling_params": greedy(3, stop_token_ids=[first], ignore_eos=True)}
    )
    assert ignored["meta_info"]["finish_reason"] == {"type": "length", "length": 3}


async def test_finish_stop_on_string_trims_unless_no_stop_trim(client: httpx.AsyncClient) -> None:
    base = await generate(client, {"text": "ab", "sampling_params": greedy(10)})
    text = base["text"]
    assert len(text) >= 3
    stop = text[2]
    cut = text.index(stop)
    out = await generate(client, {"text": "ab", "sampling_params": greedy(10, stop=[stop, "never-seen"])})
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert out["text"] == text[:cut]
    kept = await generate(client, {"text": "ab", "sampling_params": greedy(10, stop=stop, no_stop_trim=True)})
    assert kept["text"] == text[: cut + 1]


async def test_min_new_tokens_bans_stop_tokens(client: httpx.AsyncClient) -> None:
    base = await generate(client, {"text": PROMPT, "sampling_params": greedy(4)})
    first = base["output_ids"][0]
    out = await generate(
        client, {"text": PROMPT, "sampling_params": greedy(4, stop_token_ids=[first], min_new_tokens=2)}
    )
    assert out["output_ids"][0] != first
    assert out["meta_info"]["completion_tokens"] >= 2


async def test_streaming_is_cumulative_and_ends_with_done(client: httpx.AsyncClient) -> None:
    chunks = await stream_chunks(client, {"text": PROMPT, "sampling_params": greedy(5, ignore_eos=True)})
    assert chunks[-1] == "[DONE]"
    events = chunks[:-1]
    assert events[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 5}
    assert all(e["meta_info"]["finish_reason"] is None for e in events[:-1])
    lengths = [len(e["output_ids"]) for e in events]
    assert lengths == sorted(lengths) and lengths[-1] == 5
    for earlier, later in itertools.pairwise(events):
        assert later["output_ids"][: len(earlier["output_ids"])] == earlier["output_ids"]
    unstreamed = await generate(client, {"text": PROMPT, "sampling_params": greedy(5, ignore_eos=True)})
    assert events[-1]["output_ids"] == unstreamed["output_ids"]
    assert events[-1]["text"] == unstreamed["text"]


async def test_sampling_seed_is_deterministic(client: httpx.AsyncClient) -> None:
    params = {"temperature": 1.0, "max_new_tokens": 20, "ignore_eos": True}
    first = await generate(client, {"text": PROMPT, "sampling_params": {**params, "sampling_seed": 7}})
    again = await generate(client, {"text": PROMPT, "sampling_params": {**params, "sampling_seed": 7}})
    other = await generate(client, {"text": PROMPT, "sampling_params": {**params, "sampling_seed": 8}})
    assert first["output_ids"] == again["output_ids"]
    assert first["output_ids"] != other["output_ids"]


@pytest.mark.parametrize("filters", [{"top_k": 1}, {"top_p": 1e-6}, {"min_p": 1.0}])
async def test_filters_that_keep_one_token_equal_greedy(client: httpx.AsyncClient, filters: dict) -> None:
    base = await generate(client, {"text": PROMPT, "sampling_params": greedy(10, ignore_eos=True)})
    params = {"temperature": 1.0, "max_new_tokens": 10, "ignore_eos": True, **filters}
    out = await generate(client, {"text": PROMPT, "sampling_params": params})
    assert out["output_ids"] == base["output_ids"]


async def test_top_logprobs(client: httpx.AsyncClient) -> None:
    body = {
        "text": PROMPT,
        "return_logprob": True,
        "top_logprobs_num": 3,
        "sampling_params": {"max_new_tokens": 4, "ignore_eos": True, "sampling_seed": 1},
    }
    meta = (await generate(client, body))["meta_info"]
    tops = meta["output_top_logprobs"]
    assert len(tops) == 4 and all(len(entry) == 3 for entry in tops)
    for entry, (logprob, _token, _text) in zip(tops, meta["output_token_logprobs"], strict=True):
        values = [e[0] for e in entry]
        assert values == sorted(values, reverse=True) and values[0] >= logprob


@pytest.fixture(scope="module")
def reference_model(tiny_model_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()


def reference_logprobs(model: Any, ids: list[int]) -> torch.Tensor:
    """log_softmax of the float32 logits: row i scores token i + 1."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


@pytest.mark.parametrize("sampling", [{"temperature": 1.0}, {"temperature": 0.7, "top_p": 0.9, "top_k": 20}])
async def test_output_logprobs_are_log_softmax_of_raw_logits(
    client: httpx.AsyncClient, reference_model: Any, sampling: dict
) -> None:
    body = {
        "text": PROMPT,
        "return_logprob": True,
        "logprob_start_len": 0,
        "sampling_params": {**sampling, "max_new_tokens": 12, "ignore_eos": True, "sampling_seed": 3},
    }
    out = await generate(client, body)
    prompt_ids = [entry[1] for entry in out["meta_info"]["input_token_logprobs"]]
    assert len(prompt_ids) == len(PROMPT)
    ids = prompt_ids + out["output_ids"]
    reference = reference_logprobs(reference_model, ids)
    got = [entry[0] for entry in out["meta_info"]["output_token_logprobs"]]
    assert [entry[1] for entry in out["meta_info"]["output_token_logprobs"]] == out["output_ids"]
    expected = [reference[len(prompt_ids) - 1 + i, token].item() for i, token in enumerate(out["output_ids"])]
    assert got == pytest.approx(expected, abs=1e-4)
    inputs = out["meta_info"]["input_token_logprobs"]
    assert inputs[0][0] is None
    assert [e[0] for e in inputs[1:]] == pytest.approx(
        [reference[i - 1, prompt_ids[i]].item() for i in range(1, len(prompt_ids))], abs=1e-4
    )
