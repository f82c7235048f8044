"""Samples/s through the full generate path beside the fastest bare request loop, in one run.

An instant responder (aiohttp, in its own process) answers /generate with a fixed 4-token response. The
generate path (RolloutManager → DefaultRollout → dispatcher → EngineClient, with the semaphore, sample
bookkeeping and the reward) is timed against a bare `aiohttp` loop posting the same number of requests at the
same concurrency. Prints samples/s for both (the bare loop per sample and batched as the generate path sends), the ratios
(target ≥ 0.8) and the coordinator's CPU time per
sample, with the share of it the cyclic garbage collector took (start-up's heap frozen and the collector's first threshold raised first, as a run does:
`workers.collector.tune_collector`). Usage: python -m bench.rollout_overhead [--samples 4096] [--concurrency 64 512]
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import anyio

RESPONDER = r"""
import json, sys
from aiohttp import web
one = {"text": "3333", "output_ids": [8, 8, 8, 8], "meta_info": {
    "id": "x", "finish_reason": {"type": "length", "length": 4}, "prompt_tokens": 6, "completion_tokens": 4,
    "cached_tokens": 0, "weight_version": "0", "e2e_latency": 0.0,
    "output_token_logprobs": [[-0.1, 8, None]] * 4}}
body = json.dumps(one).encode()
batches = {}
async def generate(request):
    data = json.loads(await request.read())
    ids = data["input_ids"]
    if ids and isinstance(ids[0], list):  # batched: one result per prompt
        n = len(ids)
        if n not in batches:
            batches[n] = json.dumps([one] * n).encode()
        return web.Response(body=batches[n], content_type="application/json")
    return web.Response(body=body, content_type="application/json")
async def ok(request):
    return web.Response(text="ok")
async def info(request):
    return web.json_response({"weight_version": "0", "model_path": "x", "is_generation": True})
app = web.Application()
app.router.add_post("/generate", generate)
app.router.add_get("/health", ok)
app.router.add_get("/health_generate", ok)
app.router.add_get("/model_info", info)
app.router.add_post("/abort_request", ok)
web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), print=None, access_log=None)
"""


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


GROUP = 8


async def bare_loop(url: str, samples: int, concurrency: int, *, batched: bool = False) -> tuple[float, float]:
    """The floor: bare aiohttp posts, one per sample, or (batched) one per group of GROUP samples as the
    generate path sends them; at most `concurrency` samples in flight either way. Returns samples/s and CPU
    seconds per sample."""
    import aiohttp

    prompt = [8, 4, 3, 4, 6, 18]
    if batched:
        body = {"input_ids": [prompt] * GROUP, "sampling_params": [{"max_new_tokens": 4}] * GROUP,
                "return_logprob": True}
    else:
        body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 4}, "return_logprob": True}
    payload = json.dumps(body).encode()
    per_request = GROUP if batched else 1
    requests = samples // per_request
    concurrency = max(1, concurrency // per_request)
    limit = anyio.Semaphore(concurrency)
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def one() -> None:
            async with limit, session.post(url + "/generate", data=payload,
                                           headers={"Content-Type": "application/json"}) as response:
                await response.read()

        cpu0, started = time.process_time(), time.perf_counter()
        async with anyio.create_task_group() as group:
            for _ in range(requests):
                group.start_soon(one)
        done = requests * per_request
        return done / (time.perf_counter() - started), (time.process_time() - cpu0) / done


async def generate_path(url: str, model_dir: Path, samples: int, concurrency: int) -> tuple[float, float, float]:
    from transformers import AutoTokenizer

    from coordinator.cli import apply_process_environment
    from coordinator.config import parse_config
    from coordinator.engines.client import EngineClient
    from coordinator.engines.fleet import EngineFleet
    from coordinator.rollout.manager import RolloutManager
    try:
        from workers.collector import tune_collector
    except ImportError:  # a checkout from before it moved
        from coordinator.rollout.manager import tune_collector  # type: ignore[attr-defined,no-redef]

    apply_process_environment()  # as `rayless` does at its start (the tokenizer's batch calls single-threaded)
    n = GROUP
    config = parse_config(["--hf-checkpoint", str(model_dir), "--prompt-data", "builtin:first_digit",
                           "--rollout-external-engine-addrs", url, "--sglang-server-concurrency", str(concurrency),
                           "--rollout-batch-size", str(samples // n), "--n-samples-per-prompt", str(n),
                           "--num-rollout", "1", "--rollout-max-response-len", "4", "--no-progress"])
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    async with EngineClient(max_connections=concurrency) as client, anyio.create_task_group() as group:
        fleet = EngineFleet(client=client, external_urls=[url], run_dir=Path(tempfile.mkdtemp()))
        await group.start(fleet.run)
        manager = RolloutManager.build(config, tokenizer=tokenizer, client=client, pool=fleet, context_length=512)
        tune_collector()  # as coordinator.run does once the rollout manager is built
        await manager.get_rollout(0, "0")  # warm-up: connections, tokenizer caches
        with CollectorClock() as collector:
            cpu0, started = time.process_time(), time.perf_counter()
            batch = await manager.get_rollout(1, "0")
            elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu0
        group.cancel_scope.cancel()
    assert len(batch.samples) == samples
    return samples / elapsed, cpu / samples, collector.seconds / samples


class CollectorClock:
    """CPU seconds the cyclic garbage collector ran while the block ran (`gc.callbacks`)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._start = 0.0

    def _tick(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._start = time.process_time()
        else:
            self.seconds += time.process_time() - self._start

    def __enter__(self) -> CollectorClock:
        gc.callbacks.append(self._tick)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._tick)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[64, 512])
    options = parser.parse_args()
    from workers.tiny_model import build_tiny_model

    model_dir = build_tiny_model(Path(tempfile.mkdtemp()) / "tiny")
    port = free_port()
    responder = subprocess.Popen([sys.executable, "-c", RESPONDER, str(port)], env={**os.environ})
    url = f"http://127.0.0.1:{port}"
    try:
        import httpx

        for _ in range(100):
            try:
                httpx.get(url + "/health", timeout=1)
                break
            except httpx.HTTPError:
                time.sleep(0.1)
        print("samples/s; 'per sample' posts one request per sample, 'batched' one per group of "
              f"{GROUP} as the generate path does; ratios are generate path / bare loop")
        print(f"{'concurrency':>11} {'bare per sample':>16} {'bare batched':>13} {'generate path':>14} "
              f"{'÷ per sample':>13} {'÷ batched':>10} {'CPU µs/sample':>14} {'of it in gc':>12} "
              f"{'bare batched CPU µs/sample':>27}")
        for concurrency in options.concurrency:
            bare, _ = anyio.run(bare_loop, url, options.samples, concurrency)
            bare_batched, bare_cpu = anyio.run(functools.partial(bare_loop, url, options.samples, concurrency,
                                                                 batched=True))
            path, cpu, collector = anyio.run(generate_path, url, model_dir, options.samples, concurrency)
            print(f"{concurrency:>11} {bare:>16,.0f} {bare_batched:>13,.0f} {path:>14,.0f} {path / bare:>13.2f} "
                  f"{path / bare_batched:>10.2f} {cpu * 1e6:>14,.0f} {collector * 1e6:>12,.0f} "
                  f"{bare_cpu * 1e6:>27,.1f}")
    finally:
        responder.terminate()
        responder.wait(10)


if __name__ == "__main__":
    main()
