"""Benchmark: what the engine client's stall detector (`coordinator/engines/stall.py`) costs per request.

The same trivial local server as `bench/client_transport.py` (uvicorn in a child process answering a fixed
`/generate` reply), driven through `EngineClient.engine(url).generate` — the rollout's path, reply checks
included — with the detector as shipped (each `/generate` under its `ReplyClock`: one cancel scope, registered with
the running head watch while the head is awaited, the body's deadline after) and with both taken out (the plain `async with http.stream(...)` and body reads of before).
Rounds alternate, so load on the machine hits both alike; the median of each is compared (goal: ≥ 0.98×).
Besides requests/s (wall clock, which other processes' load moves), the client process's own CPU time per
request is printed: what the detector adds to the coordinator, whatever else runs on the machine.

Run: .venv/bin/python -m bench.engine_stall [--requests 3000] [--concurrency 64] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from typing import Any

import anyio

from bench.client_transport import PAYLOAD, SERVER_SRC, drive, free_port, wait_up
from coordinator.engines import client as client_module
from coordinator.engines.client import EngineClient

SHIPPED = client_module.ReplyClock


class _NoClock:
    """The body read as before: nothing counted, no deadline."""

    def __init__(self, **_: Any) -> None:
        pass

    def headed(self) -> None:
        pass

    def advance(self, size: int) -> None:
        pass

    def __enter__(self) -> _NoClock:
        return self

    def __exit__(self, *_: object) -> None:
        return None


def detector(on: bool) -> None:
    """Put the shipped detector in the client module, or the plain reads it replaced (this process only)."""
    client_module.ReplyClock = SHIPPED if on else _NoClock  # type: ignore[assignment,misc]


async def rate(url: str, n: int, conc: int) -> tuple[float, float]:
    """(requests/s, this process's CPU µs per request)."""
    async with EngineClient(max_connections=conc) as client, anyio.create_task_group() as group:
        await group.start(client.watch_stalls)
        engine = client.engine(url)

        async def one() -> None:
            await engine.generate(PAYLOAD)

        await drive(min(conc, n), conc, one)  # warm the pool
        cpu = time.process_time()
        result = await drive(n, conc, one)
        cpu = time.process_time() - cpu
        group.cancel_scope.cancel()
        return result, cpu / n * 1e6


async def main(n: int, conc: int, rounds: int) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([sys.executable, "-c", SERVER_SRC, str(port)], start_new_session=True)  # noqa: ASYNC220
    try:
        await wait_up(url + "/generate")
        figures: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
        for _ in range(rounds):
            for on in (False, True):
                detector(on)
                figures[on].append(await rate(url, n, conc))
        detector(True)
        print(f"{n} /generate calls at concurrency {conc}, median of {rounds} alternating rounds:")
        medians = {}
        for on, label in ((False, "without the stall detector"), (True, "with it (as shipped)      ")):
            rates, cpus = [r for r, _ in figures[on]], [c for _, c in figures[on]]
            medians[on] = statistics.median(rates), statistics.median(cpus)
            print(f"  {label}  {medians[on][0]:8.0f} req/s  {medians[on][1]:6.0f} CPU-µs/request   "
                  f"req/s {[round(x) for x in rates]}")
        print(f"  with / without: req/s {medians[True][0] / medians[False][0]:.3f}, CPU per request "
              f"{medians[True][1] / medians[False][1]:.3f} (+{medians[True][1] - medians[False][1]:.0f} µs)")
    finally:
        server.terminate()
        server.wait(timeout=10)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    options = parser.parse_args()
    anyio.run(main, options.requests, options.concurrency, options.rounds)
