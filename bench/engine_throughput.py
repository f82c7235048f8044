"""Generated tokens/s of one CPU engine at concurrency 1 and 64, in the same run, and the engine's memory.

Owns nothing but its measurement. The floor is the same engine at concurrency 1 measured seconds earlier, so the
ratio says whether requests really are batched together (target >= 4), whatever the machine's speed.

    .venv/bin/python -m bench.engine_throughput [--model-path DIR] [--max-new-tokens 64] [--threads 1]

Exit code 0 when the ratio reaches --min-ratio, 1 otherwise.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import aiohttp
import anyio
import psutil

from tests.support.engine_proc import start_engine_process


async def run_load(
    url: str, *, concurrency: int, requests: int, max_new_tokens: int, pid: int
) -> dict[str, float]:
    """`requests` generations, at most `concurrency` in flight; returns tokens/s and peak engine RSS."""
    body = {
        "text": "1 2 3=",
        "sampling_params": {"temperature": 1.0, "max_new_tokens": max_new_tokens, "ignore_eos": True},
    }
    tokens = 0
    peak_rss = 0
    process = psutil.Process(pid)
    remaining = requests
    done = anyio.Event()

    async def worker(session: aiohttp.ClientSession) -> None:
        nonlocal tokens, remaining
        while remaining > 0:
            remaining -= 1
            async with session.post(url + "/generate", json=body) as response:
                response.raise_for_status()
                tokens += (await response.json())["meta_info"]["completion_tokens"]

    async def sample_memory() -> None:
        nonlocal peak_rss
        while not done.is_set():
            peak_rss = max(peak_rss, process.memory_info().rss)
            with anyio.move_on_after(0.2):
                await done.wait()

    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(
        connector=connector, timeout=aiohttp.ClientTimeout(total=600)
    ) as session:
        started = time.perf_counter()
        async with anyio.create_task_group() as tg:
            tg.start_soon(sample_memory)
            async with anyio.create_task_group() as workers:
                for _ in range(concurrency):
                    workers.start_soon(worker, session)
            elapsed = time.perf_counter() - started
            done.set()
    return {"tokens": tokens, "seconds": elapsed, "tokens_per_s": tokens / elapsed, "peak_rss": peak_rss}


async def bench(url: str, pid: int, args: argparse.Namespace) -> float:
    await run_load(url, concurrency=4, requests=8, max_new_tokens=8, pid=pid)  # warm-up
    results = {}
    for concurrency, requests in ((1, args.requests_c1), (64, args.requests_c64)):
        results[concurrency] = await run_load(
            url, concurrency=concurrency, requests=requests, max_new_tokens=args.max_new_tokens, pid=pid
        )
        r = results[concurrency]
        print(
            f"concurrency {concurrency:>3}: {r['tokens']:>6} tokens in {r['seconds']:6.2f} s = "
            f"{r['tokens_per_s']:8.1f} tokens/s   peak engine RSS {r['peak_rss'] / 2**20:7.1f} MiB"
        )
    ratio = results[64]["tokens_per_s"] / results[1]["tokens_per_s"]
    rss = psutil.Process(pid).memory_info().rss
    print(f"ratio c64 / c1: {ratio:.2f} (target >= {args.min_ratio})")
    print(f"engine RSS after the run: {rss / 2**20:.1f} MiB")
    return ratio


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-path", default=None, help="default: build the tiny model in a temp dir")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--requests-c1", type=int, default=16)
    parser.add_argument("--requests-c64", type=int, default=256)
    parser.add_argument("--threads", type=int, default=1, help="torch threads in the engine")
    parser.add_argument("--min-ratio", type=float, default=4.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="rayless-bench-") as scratch:
        model_path = args.model_path
        if model_path is None:
            from workers.tiny_model import build_tiny_model

            model_path = str(build_tiny_model(Path(scratch) / "tiny-model"))
        with start_engine_process(
            model_path, threads=args.threads, log_path=Path(scratch) / "engine.log"
        ) as engine:
            print(
                f"engine pid {engine.process.pid} at {engine.url}, model {model_path}, threads {args.threads}"
            )
            ratio = anyio.run(bench, engine.url, engine.process.pid, args)
    return 0 if ratio >= args.min_ratio else 1


if __name__ == "__main__":
    raise SystemExit(main())
