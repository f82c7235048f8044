"""How long the HealthMonitor takes to find a dead engine, among 1, 4 and 16 engines, in one run.

Engines are instant responders (tests/support/fake_engine.py: a FAKE engine answering /health_generate at
once), so the figure is the monitor's own latency. Two faults per size: a *hung* engine (accepts connections,
never answers /health_generate, /metrics stands still — what SIGSTOP looks like) and a *dead* one (connection
refused). The bound printed beside them is the configured threshold·interval + timeout (threshold 2: interval
+ timeout + one interval). Probes of different engines run concurrently, so detection must not grow with the
number of engines.

    .venv/bin/python -m bench.health_probe [--interval 0.5] [--timeout 1.0]
"""

from __future__ import annotations

import argparse
import logging
import tempfile
import time
from pathlib import Path

import anyio

from coordinator.engines.client import EngineClient
from coordinator.engines.fleet import EngineFleet
from coordinator.engines.health import HealthMonitor
from tests.support.fake_engine import FakeEngine


async def detect(engines: int, fault: str, interval: float, timeout: float, threshold: int) -> float:
    fakes = [FakeEngine() for _ in range(engines)]
    with tempfile.TemporaryDirectory() as run_dir:
        async with EngineClient(max_connections=4 * engines) as client, anyio.create_task_group() as group:
            for fake in fakes:
                await group.start(fake.run)
            fleet = EngineFleet(client=client, external_urls=[f.url for f in fakes], run_dir=Path(run_dir),
                                probe_timeout=timeout)
            await group.start(fleet.run)
            monitor = HealthMonitor(fleet=fleet, client=client, interval=interval, timeout=timeout,
                                    failure_threshold=threshold)
            await group.start(monitor.run)
            await anyio.sleep(2 * interval)  # every engine probed healthy a few times
            victim = fakes[engines // 2]
            started = time.monotonic()
            if fault == "hung":
                victim.health = "hang"
            else:
                victim.stop_serving()
            with anyio.fail_after(10 * monitor.detection_bound):
                while not any(e.kind == "dead" for e in monitor.events):  # noqa: ASYNC110 - polls the monitor's log
                    await anyio.sleep(0.005)
            detected = next(e.at for e in monitor.events if e.kind == "dead") - started
            assert monitor.stats.deaths == 1, "only the victim is declared dead"
            group.cancel_scope.cancel()
    return detected


async def main(interval: float, timeout: float, threshold: int) -> None:
    bound = threshold * interval + timeout
    print(f"interval {interval}s, timeout {timeout}s, threshold {threshold}: bound {bound:.2f}s")
    print(f"{'engines':>8} {'hung: detected':>15} {'/bound':>7} {'refused: detected':>18} {'/bound':>7}")
    results: dict[int, float] = {}
    for engines in (1, 4, 16):
        hung = await detect(engines, "hung", interval, timeout, threshold)
        refused = await detect(engines, "refused", interval, timeout, threshold)
        results[engines] = hung
        print(f"{engines:>8} {hung:>14.2f}s {hung / bound:>7.2f} {refused:>17.2f}s {refused / bound:>7.2f}")
    print(f"hung detection, 16 engines vs 1: x{results[16] / results[1]:.2f} (concurrent probing: ~x1)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--interval", type=float, default=0.5)
    parser.add_argument("--timeout", type=float, default=1.0)
    parser.add_argument("--threshold", type=int, default=2)
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)
    anyio.run(main, args.interval, args.timeout, args.threshold)
