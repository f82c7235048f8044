"""The cost of the loop watchdog and the rank-command watch to the coordinator's event loop, against the same
loop without them, in one process.

The workload is the loop's own kind of work at its busiest: `--tasks` tasks handing messages through memory
streams (what the rollout's dispatch and the engine client's request tasks do between network waits), as fast
as the loop turns. Blocks of `--block-s` seconds alternate between "watched" (a `LoopWatchdog` at the default
threshold with its thread, and a `RankCallWatch` looking at a command in flight every second) and "bare";
the first block of each is dropped (warm-up). Prints the messages per second of each and their ratio
(goal: watched ≥ 0.98 × bare), and the watchdog's largest measured lag. Usage:
python -m bench.watchdog_overhead [--blocks 6] [--block-s 2] [--tasks 64]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from coordinator.observe.rank_watch import RankCallWatch
from coordinator.observe.watchdog import LoopWatchdog

TARGET = 0.98


class IdleCommand:
    """A command in flight that every rank has answered: the watch reads it each check and never warns."""

    kind = "train"

    def __init__(self) -> None:
        self.started = time.monotonic()

    def waiting(self) -> list[int]:
        return []


async def relay(receive: MemoryObjectReceiveStream[int], send: MemoryObjectSendStream[int]) -> None:
    async with receive, send:
        async for message in receive:
            await send.send(message + 1)


async def block(tasks: int, seconds: float) -> float:
    """Messages per second through a ring of `tasks` relays for `seconds`."""
    count = 0
    async with anyio.create_task_group() as group:
        first_send, receive = anyio.create_memory_object_stream[int](1)
        for _ in range(tasks - 1):
            send, next_receive = anyio.create_memory_object_stream[int](1)
            group.start_soon(relay, receive, send)
            receive = next_receive
        deadline = time.perf_counter() + seconds
        started = time.perf_counter()
        async with first_send, receive:
            while time.perf_counter() < deadline:
                await first_send.send(0)
                await receive.receive()
                count += tasks
        elapsed = time.perf_counter() - started
    return count / elapsed


async def main_async(args: argparse.Namespace) -> None:
    rates: dict[str, list[float]] = {"bare": [], "watched": []}
    largest_lag = 0.0
    for index in range(args.blocks * 2):
        watched = index % 2 == 1
        async with anyio.create_task_group() as group:
            if watched:
                watchdog = LoopWatchdog(10.0)
                await group.start(watchdog.run)
                command = IdleCommand()
                watch = RankCallWatch(in_flight=lambda command=command: command, longest_s=lambda kind: 1.0,
                                      rank_pid=lambda rank: None, floor_s=300.0, stacks_dir=Path("/nonexistent"))
                await group.start(watch.run)
            rate = await block(args.tasks, args.block_s)
            if watched:
                largest_lag = max(largest_lag, watchdog.stats.max_s)
            group.cancel_scope.cancel()
        if index >= 2:  # the first block of each condition warms up
            rates["watched" if watched else "bare"].append(rate)
    bare, watched_rate = statistics.median(rates["bare"]), statistics.median(rates["watched"])
    ratio = watched_rate / bare
    print(f"bare:    {bare:,.0f} messages/s (median of {len(rates['bare'])} blocks of {args.block_s:g}s)")
    print(f"watched: {watched_rate:,.0f} messages/s ({ratio:.3f}x bare; goal >= {TARGET})")
    print(f"the watchdog's largest lag measured while watched: {largest_lag * 1000:.1f} ms")
    print("PASS" if ratio >= TARGET else "BELOW TARGET")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=6, help="blocks of each condition (first one dropped)")
    parser.add_argument("--block-s", type=float, default=2.0)
    parser.add_argument("--tasks", type=int, default=64)
    anyio.run(main_async, parser.parse_args())


if __name__ == "__main__":
    main()
