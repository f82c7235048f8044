"""Hostile or careless requests to a real engine (issue 15, item 2): each kind gets a 4xx, and another client's
generation running meanwhile still completes, untouched.

The engine here runs with small request bounds (`--max-seqs-per-request 64`, `--max-request-bytes 8 MiB`) so
the refusals are cheap to provoke; the defaults are checked by the parser tests.
"""

from __future__ import annotations

import json
import socket
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from tests.support.engine_proc import RunningEngine, start_engine_process
from tests.support.sockets import close_all, first_reply, open_idle, raw_exchange
from tests.support.waiting import wait_until_sync
from workers.boundary.http_server import raise_open_files_limit

VICTIM_TOKENS = 200
DEEP = b"[" * 100_000 + b"]" * 100_000


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> Iterator[RunningEngine]:
    extra = ["--max-seqs-per-request", "64", "--max-n", "16", "--max-request-bytes", str(8 << 20),
             "--max-message-bytes", str(1 << 20), "--trust-request-chat-template"]
    with start_engine_process(tiny_model_dir, extra_args=[*extra, "--log-level", "info"]) as running:
        yield running


@pytest.fixture
async def client(engine: RunningEngine) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=engine.url, timeout=120.0) as http:
        yield http


def text_body(**params: Any) -> dict[str, Any]:
    return {"text": "1 2 3=", "sampling_params": {"max_new_tokens": 2, **params}}


# (name, method, path, body: dict → JSON, bytes → raw)
HOSTILE: list[tuple[str, str, str, Any]] = [
    ("n huge", "POST", "/generate", text_body(n=10_000_000)),
    ("prompts x n", "POST", "/generate", {"text": ["1"] * 20, "sampling_params": {"n": 16}}),
    ("many prompts", "POST", "/generate", {"input_ids": [[5]] * 65}),
    ("prompt over context", "POST", "/generate", {"input_ids": [5] * 512, "sampling_params": {"max_new_tokens": 0}}),
    ("5 MB prompt", "POST", "/generate", {"text": "1 2 3 " * 900_000}),
    ("sampling_seed beyond int64", "POST", "/generate", text_body(sampling_seed=2**64)),
    ("top_k beyond int64", "POST", "/generate", text_body(top_k=2**70, temperature=1.0)),
    ("max_new_tokens beyond int64", "POST", "/generate", text_body(max_new_tokens=2**80)),
    ("logprob_start_len beyond int64", "POST", "/generate", {**text_body(), "logprob_start_len": 2**64}),
    ("top_logprobs_num negative", "POST", "/generate", {**text_body(), "top_logprobs_num": -3}),
    ("NaN temperature", "POST", "/generate", b'{"text": "1", "sampling_params": {"temperature": NaN}}'),
    ("bad stop_regex", "POST", "/generate", text_body(stop_regex="(unclosed")),
    ("logit_bias outside vocab", "POST", "/generate", text_body(logit_bias={"999999": 1.0})),
    ("int beyond 4300 digits", "POST", "/generate", b'{"text": "1", "sampling_params": {"n": ' + b"9" * 5000 + b"}}"),
    ("unhashable tags", "POST", "/release_memory_occupation", {"tags": [["weights"]]}),
    ("unknown tags", "POST", "/resume_memory_occupation", {"tags": ["everything"]}),
    ("tags not a list", "POST", "/release_memory_occupation", {"tags": {"weights": 1}}),
    ("body not an object", "POST", "/abort_request", b"[1, 2]"),
    *[
        (f"deep JSON {path}", "POST", path, DEEP)
        for path in (
            "/generate",
            "/update_weight_version",
            "/abort_request",
            "/pause_generation",
            "/release_memory_occupation",
            "/resume_memory_occupation",
            "/update_weights_from_disk",
            "/init_weights_update_group",
            "/update_weights_from_distributed",
            "/destroy_weights_update_group",
        )
    ],
    ("JSON 40 levels deep", "POST", "/generate", {"text": "1", "rid": json.loads("[" * 40 + "]" * 40)}),
    # the structured wire formats (Anthropic Messages, OpenAI Responses) pass the same gates; their field checks
    # are unit-tested (tests/unit/test_engine_structured_formats.py)
    *[(f"deep JSON {path}", "POST", path, DEEP) for path in ("/v1/messages", "/v1/responses")],
]


async def victim(client: httpx.AsyncClient, started: anyio.Event, out: list[Any]) -> None:
    """Another client's long generation, streamed, so it is mid-batch while the hostile requests arrive."""
    body = {
        "text": "9 8 7=",
        "stream": True,
        "sampling_params": {"max_new_tokens": VICTIM_TOKENS, "ignore_eos": True, "temperature": 0.7, "top_k": 5},
    }
    async with client.stream("POST", "/generate", json=body) as response:
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                out.append(json.loads(line.removeprefix("data: ")))
                started.set()


@pytest.mark.parametrize(("name", "method", "path", "body"), HOSTILE, ids=[h[0] for h in HOSTILE])
async def test_hostile_request_is_4xx_and_others_keep_generating(
    client: httpx.AsyncClient, name: str, method: str, path: str, body: Any
) -> None:
    started, chunks = anyio.Event(), []
    async with anyio.create_task_group() as tg:
        tg.start_soon(victim, client, started, chunks)
        await started.wait()
        kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
        response = await client.request(method, path, **kwargs)
        assert 400 <= response.status_code < 500, (name, response.status_code, response.text[:300])
        message = json.dumps(response.json())
        assert len(message) < 2000  # bounded: the hostile value is never echoed whole
        assert (await client.get("/health")).status_code == 200
    final = chunks[-1]["meta_info"]
    assert final["finish_reason"] == {"type": "length", "length": VICTIM_TOKENS}, (name, final)
    assert (await client.get("/server_info")).json()["internal_states"][0]["memory_released"] == []


async def test_top_k_beyond_the_vocabulary_joins_the_batch_harmlessly(client: httpx.AsyncClient) -> None:
    """A top_k inside int64 but far past the vocabulary (it overflowed the sampler and aborted the whole batch)."""
    started, chunks = anyio.Event(), []
    async with anyio.create_task_group() as tg:
        tg.start_soon(victim, client, started, chunks)
        await started.wait()
        odd = await client.post("/generate", json=text_body(top_k=2**62, temperature=1.0, max_new_tokens=20))
        assert odd.status_code == 200 and odd.json()["meta_info"]["completion_tokens"] >= 1
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": VICTIM_TOKENS}


async def test_body_over_the_limit_is_413_or_400(client: httpx.AsyncClient, engine: RunningEngine) -> None:
    big = b'{"text": "' + b"1" * (9 << 20) + b'"}'
    declared = await client.post("/generate", content=big)
    assert declared.status_code == 413 and "--max-request-bytes" in declared.json()["error"]["message"]

    async def chunked() -> AsyncIterator[bytes]:  # no Content-Length: cut off while reading
        for start in range(0, len(big), 1 << 20):
            yield big[start : start + (1 << 20)]

    streamed = await client.post("/generate", content=chunked())
    assert streamed.status_code == 400 and "--max-request-bytes" in streamed.json()["error"]["message"]


async def test_a_message_or_a_declared_body_over_its_limit_is_413(client: httpx.AsyncClient,
                                                                  engine: RunningEngine) -> None:
    """A 30 MB message (over the body limit here), a 2 MB one (under it, over the per-message limit) and a 2 GB
    declared body, its headers alone sent: each a 413, never a wait (bench/agent_limits.py times them)."""
    for size, words in ((30 << 20, "--max-request-bytes"), (2 << 20, "--max-message-bytes")):
        body = {"model": "m", "messages": [{"role": "user", "content": "x" * size}], "max_tokens": 1}
        answer = await client.post("/v1/chat/completions", json=body, timeout=30)
        assert answer.status_code == 413, (size, answer.text[:300])
        assert words in json.dumps(answer.json())
    host, port = engine.url.removeprefix("http://").split(":")
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 2147483648\r\n\r\n")
    reply = await anyio.to_thread.run_sync(lambda: first_reply(host, int(port), head, timeout=10))
    assert reply.startswith(b"HTTP/1.1 413"), reply[:200]


async def test_a_request_template_of_1e10_iterations_stops_at_its_deadline(client: httpx.AsyncClient) -> None:
    """With --trust-request-chat-template a request's own template is rendered, in the sandbox and under the
    deadline: nested loops of 1e10 iterations end with a 400, /health answering all along; `'x' * 10**10` is
    refused without being built; a plain request template renders."""
    bomb = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    answers: list[int] = []

    async def probe_until_done(done: anyio.Event) -> None:
        while not done.is_set():
            answers.append((await client.get("/health", timeout=1.0)).status_code)
            await anyio.sleep(0.05)

    def chat(template: str) -> dict[str, Any]:
        return {"model": "m", "messages": [{"role": "user", "content": "1"}], "max_tokens": 1,
                "chat_template_kwargs": {"chat_template": template}}

    done = anyio.Event()
    async with anyio.create_task_group() as tg:
        tg.start_soon(probe_until_done, done)
        stopped = await client.post("/v1/chat/completions", json=chat(bomb))
        done.set()
    assert stopped.status_code == 400 and "deadline" in stopped.json()["message"], stopped.text[:300]
    assert len(answers) >= 5 and set(answers) == {200}
    huge = await client.post("/v1/chat/completions", json=chat("{{ 'x' * 10**10 }}"))
    assert huge.status_code == 400 and "repetition" in huge.json()["message"]
    plain = await client.post("/v1/chat/completions", json=chat("{% for m in messages %}{{ m.content }}{% endfor %}="))
    assert plain.status_code == 200 and plain.json()["usage"]["prompt_tokens"] == 2


async def test_health_answers_while_a_huge_prompt_is_tokenized(client: httpx.AsyncClient) -> None:
    """13 characters per token (a special token) pass the cheap prefix check, so the whole 6 MB is tokenized —
    off the event loop — before the prompt is refused."""
    body = {"text": "<|endoftext|>" * 480_000, "sampling_params": {"max_new_tokens": 1}}
    answers: list[int] = []

    async def probe_until_done(done: anyio.Event) -> None:
        while not done.is_set():
            answers.append((await client.get("/health")).status_code)
            await anyio.sleep(0.05)

    done = anyio.Event()
    async with anyio.create_task_group() as tg:
        tg.start_soon(probe_until_done, done)
        refused = await client.post("/generate", json=body)
        done.set()
    assert refused.status_code == 400 and "context length" in refused.json()["error"]["message"]
    assert answers and set(answers) == {200}


def test_disconnect_mid_body_is_one_log_line(engine: RunningEngine) -> None:
    host, port = engine.url.removeprefix("http://").split(":")
    for _ in range(5):
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.sendall(
                b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: 1000\r\n\r\n" + b'{"text": "1 2'
            )
    with httpx.Client(base_url=engine.url, timeout=30) as http:  # the engine still serves
        assert http.post("/generate", json=text_body()).status_code == 200

    def logged() -> list[str]:
        text = engine.log_path.read_text()
        return [line for line in text.splitlines() if "disconnected before sending the whole body" in line]

    # the engine notices each closed socket on its own schedule
    wait_until_sync(logged, until=lambda lines: len(lines) >= 5, timeout=20,
                    what="the engine logging the 5 disconnected bodies")
    assert len(logged()) == 5
    log = engine.log_path.read_text()
    assert "Traceback" not in log and "ClientDisconnect" not in log


def test_a_head_over_16_KiB_is_431_and_2000_idle_connections_leave_health_answering(engine: RunningEngine) -> None:
    """The engine on the shared HTTP layer (workers.boundary.http_server): its head limit and connection cap."""
    host, port = engine.url.removeprefix("http://").split(":")
    pad = b"a" * 20_000
    refused = raw_exchange(host, int(port), b"GET /health HTTP/1.1\r\nHost: x\r\nX-Pad: " + pad + b"\r\n\r\n")
    assert refused.startswith(b"HTTP/1.1 431 "), refused[:200]
    if raise_open_files_limit() < 2 * 2000 + 512:
        pytest.skip("the open-files limit is too low for 2,000 connections")
    held = open_idle(host, int(port), 2000)  # past the engine's cap of 1,024: the oldest idle ones make room
    try:
        with httpx.Client(base_url=engine.url, timeout=30) as http:
            assert http.get("/health").status_code == 200
            assert http.post("/generate", json=text_body()).status_code == 200
    finally:
        close_all(held)
