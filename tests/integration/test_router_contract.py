"""The engine contract tests again, through a real sglang-router (PyPI wheel) in front of two CPU engines.

The tests are the shared ones in tests.support.generate_contract (also run directly against an engine by
test_engine_contract.py), imported here so pytest runs them with this module's `engine_url` fixture (the
router). Only the generate path is run through the router: the router proxies
`/generate`, `/health*` and `/model_info`, while per-engine control endpoints (abort, pause, flush, weights,
metrics) are addressed to each engine directly by rayless and are covered by the direct suite. Of the generate
tests, those whose request shape the router itself refuses are left out, with the router behaviour named:
batched `text` lists and the `rid`-echo test. Input rejection is re-stated below for the router: it
answers ill-typed fields itself with 422, drops unknown sampling keys (as SGLANG_CONTRACT.md says), and passes
well-typed but out-of-range values to the engine, which answers 400.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support.engine_proc import free_port, start_engine
from tests.support.generate_contract import (  # noqa: F401 - tests collected here against the router, and their fixtures
    client,
    generate,
    reference_model,
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
from tests.support.waiting import wait_until_sync

pytest.importorskip("sglang_router")


@pytest.fixture(scope="module")
def engine_url(tiny_model_dir: Path) -> Iterator[str]:
    with start_engine(tiny_model_dir) as first, start_engine(tiny_model_dir) as second:
        port, metrics_port = free_port(), free_port()
        log = Path(tempfile.mkstemp(prefix="rayless-router-", suffix=".log")[1])
        command = [sys.executable, "-m", "sglang_router.launch_router", "--worker-urls", first, second,
                   "--policy", "round_robin", "--host", "127.0.0.1", "--port", str(port),
                   "--prometheus-port", str(metrics_port)]
        with log.open("wb") as out:
            router = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        url = f"http://127.0.0.1:{port}"
        try:
            def ready() -> bool:
                if router.poll() is not None:
                    raise RuntimeError(f"sglang-router exited: {log.read_text()[-2000:]}")
                answer = httpx.post(f"{url}/generate", json={"text": "1", "sampling_params": {"max_new_tokens": 1}},
                                    timeout=5)
                return answer.status_code == 200

            try:
                wait_until_sync(ready, timeout=60, interval=0.3, ignoring=(httpx.HTTPError,),
                                what="sglang-router generating")
            except AssertionError as error:
                raise RuntimeError(f"sglang-router not ready: {error}: {log.read_text()[-2000:]}") from None
            yield url
        finally:
            os.killpg(router.pid, signal.SIGTERM)
            try:
                router.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(router.pid, signal.SIGKILL)
                router.wait(10)
            log.unlink(missing_ok=True)


@pytest.mark.parametrize(
    ("body", "status", "needle"),
    [
        ({"text": "1", "sampling_params": {"temperature": -1}}, 400, "temperature"),
        ({"text": "1", "sampling_params": {"top_p": 1.5}}, 400, "top_p"),
        ({"text": "1" * 500, "sampling_params": {"max_new_tokens": 100}}, 400, "context length"),
        ({"text": "1", "sampling_params": {"max_new_tokens": -1}}, 422, "max_new_tokens"),
        ({"text": "1", "sampling_params": {"temperature": "hot"}}, 422, "temperature"),
        ({"text": ["1", "2"], "sampling_params": {}}, 422, "text"),
    ],
)
async def test_router_rejects_bad_input_with_a_4xx_naming_the_field(client, body: dict, status: int,  # noqa: F811
                                                                   needle: str) -> None:
    response = await client.post("/generate", json=body)
    assert response.status_code == status, response.text
    assert needle in response.text


async def test_router_drops_unknown_sampling_keys(client) -> None:  # noqa: F811
    out = await generate(client, {"text": "1", "sampling_params": {"bogus_key": 1, "max_new_tokens": 2}})
    assert len(out["output_ids"]) <= 2
