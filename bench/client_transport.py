"""Benchmark: which HTTP transport the engine client uses (the client must not be the bottleneck).

Starts a trivial local ASGI server (uvicorn, a raw ASGI app answering a fixed /generate-shaped JSON) in a
child process, then sends the same number of POSTs at concurrency 64 and 512 with:

  * httpx.AsyncClient with its default transport (httpcore),
  * httpx.AsyncClient over httpx_aiohttp.AiohttpTransport,
  * bare aiohttp.ClientSession,
  * the engine client's own request (`EngineClient.request`: aiohttp's session with the retry loop, deadlines,
    stall clock and capped read),
  * a pooled raw HTTP/1.1 client (asyncio streams, keep-alive sockets, Content-Length bodies only: the
    socket's floor, not a client anyone should ship),

and prints requests/s and each figure as a ratio of the floor (httpx default) measured in the same run.
The server runs in its own process so the client's event loop is the only thing measured in this one.

Run: .venv/bin/python -m bench.client_transport [--requests 4000] [--concurrency 64 512]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable

import aiohttp
import anyio
import httpx
from httpx_aiohttp import AiohttpTransport

RESPONSE = json.dumps(
    {
        "text": "hello world",
        "output_ids": [1, 2, 3, 4],
        "meta_info": {
            "id": "abc",
            "finish_reason": {"type": "length", "length": 4},
            "prompt_tokens": 8,
            "completion_tokens": 4,
            "cached_tokens": 0,
            "weight_version": "default",
            "e2e_latency": 0.001,
        },
    }
).encode()

PAYLOAD = {"input_ids": list(range(64)), "sampling_params": {"max_new_tokens": 4, "temperature": 1.0}}

SERVER_SRC = f"""
import uvicorn
BODY = {RESPONSE!r}
async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    more = True
    while more:
        msg = await receive()
        more = msg.get("more_body", False)
    await send({{"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(BODY)).encode())]}})
    await send({{"type": "http.response.body", "body": BODY}})
import sys
uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning", access_log=False, backlog=4096)
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def wait_up(url: str) -> None:
    with anyio.fail_after(20):
        while True:
            try:
                async with httpx.AsyncClient() as c:
                    await c.post(url, json={})
                return
            except httpx.TransportError:
                await anyio.sleep(0.05)


async def drive(n: int, conc: int, one: Callable[[], Awaitable[None]]) -> float:
    """Run `n` calls of `one` with at most `conc` in flight; return requests/s."""
    remaining = n

    async def worker() -> None:
        nonlocal remaining
        while remaining > 0:
            remaining -= 1
            await one()

    t0 = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for _ in range(conc):
            tg.start_soon(worker)
    return n / (time.perf_counter() - t0)


def limits(conc: int) -> httpx.Limits:
    return httpx.Limits(max_connections=conc, max_keepalive_connections=conc)


async def bench_httpx_default(url: str, n: int, conc: int) -> float:
    async with httpx.AsyncClient(limits=limits(conc), timeout=60) as c:

        async def one() -> None:
            r = await c.post(url, json=PAYLOAD)
            r.raise_for_status()
            r.json()

        await drive(min(conc, n), conc, one)  # warm the pool
        return await drive(n, conc, one)


async def bench_httpx_aiohttp(url: str, n: int, conc: int) -> float:
    async with httpx.AsyncClient(transport=AiohttpTransport(limits=limits(conc)), timeout=60) as c:

        async def one() -> None:
            r = await c.post(url, json=PAYLOAD)
            r.raise_for_status()
            r.json()

        await drive(min(conc, n), conc, one)
        return await drive(n, conc, one)


async def bench_aiohttp(url: str, n: int, conc: int) -> float:
    conn = aiohttp.TCPConnector(limit=conc)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=60)) as s:

        async def one() -> None:
            async with s.post(url, json=PAYLOAD) as r:
                r.raise_for_status()
                await r.json()

        await drive(min(conc, n), conc, one)
        return await drive(n, conc, one)


async def bench_engine_client(url: str, n: int, conc: int) -> float:
    from coordinator.engines.client import EngineClient

    base, path = url.rsplit("/", 1)
    async with EngineClient(max_connections=conc) as client:

        async def one() -> None:
            json.loads((await client.request(base, "POST", "/" + path, json_body=PAYLOAD)).content)

        await drive(min(conc, n), conc, one)
        return await drive(n, conc, one)


async def bench_raw(url: str, n: int, conc: int) -> float:
    """The floor: one keep-alive socket per worker, a request written whole, the answer read by its
    Content-Length."""
    host, port_path = url.removeprefix("http://").split(":", 1)
    port, path = port_path.split("/", 1)
    body = json.dumps(PAYLOAD).encode()
    head = (f"POST /{path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    pool: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []

    async def one() -> None:
        reader, writer = pool.pop() if pool else await asyncio.open_connection(host, int(port))
        writer.write(head + body)
        status = await reader.readuntil(b"\r\n\r\n")
        if not status.startswith(b"HTTP/1.1 200"):
            raise RuntimeError(status[:64])
        length = next(int(line.split(b":", 1)[1]) for line in status.split(b"\r\n")
                      if line.lower().startswith(b"content-length:"))
        json.loads(await reader.readexactly(length))
        pool.append((reader, writer))

    await drive(min(conc, n), conc, one)
    rate = await drive(n, conc, one)
    for _, writer in pool:
        writer.close()
    return rate


async def main(n: int, concs: list[int]) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}/generate"
    cmd = [sys.executable, "-c", SERVER_SRC, str(port)]
    server = subprocess.Popen(cmd, start_new_session=True)  # noqa: ASYNC220 - returns after exec
    try:
        await wait_up(url)
        for conc in concs:
            floor = await bench_httpx_default(url, n, conc)
            via = await bench_httpx_aiohttp(url, n, conc)
            bare = await bench_aiohttp(url, n, conc)
            ours = await bench_engine_client(url, n, conc)
            raw = await bench_raw(url, n, conc)
            print(f"concurrency {conc}, {n} POSTs:")
            print(f"  httpx default transport   {floor:8.0f} req/s   x1.00 (floor)")
            print(f"  httpx + AiohttpTransport  {via:8.0f} req/s   x{via / floor:.2f}")
            print(f"  bare aiohttp              {bare:8.0f} req/s   x{bare / floor:.2f}")
            print(f"  EngineClient.request      {ours:8.0f} req/s   x{ours / floor:.2f}")
            print(f"  pooled raw HTTP/1.1       {raw:8.0f} req/s   x{raw / floor:.2f}")
            print(f"  httpx+aiohttp / bare aiohttp = {via / bare:.2f}; EngineClient / bare aiohttp = {ours / bare:.2f}; "
                  f"bare aiohttp / raw = {bare / raw:.2f}")
    finally:
        server.terminate()
        try:
            server.wait(5)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=4000)
    p.add_argument("--concurrency", type=int, nargs="+", default=[64, 512])
    a = p.parse_args()
    anyio.run(main, a.requests, a.concurrency)
