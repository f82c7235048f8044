"""Benchmark: the control channel's codec on a rollout's shard, beside plain msgpack of the same bytes.

Measures, in one run, for TrainCommands of N samples (prompt + response tokens, one logprob per response
token): frame bytes, the best of R encodes and decodes through `workers.protocol` (typed: every field's type
checked while decoding), and the floor — msgpack-python packing / unpacking the same plain values, building no
message and checking nothing — with the ratio ours / floor. Time grows linearly in N for both. Then the same
for a rank's typed reply to a TrainCommand (a `Response` holding a `TrainResult` of S steps' `StepMetrics`).

    .venv/bin/python -m bench.wire_codec [--samples 32 128 512] [--tokens 1024] [--repeats 5]

About 20 CPU-seconds with the defaults.
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable
from typing import Any

import msgpack

from workers import protocol


def shard(count: int, tokens: int, seed: int = 0) -> protocol.Request:
    rng = random.Random(seed)
    response = tokens // 2
    samples = [
        protocol.WireSample(
            tokens=[rng.randrange(151_000) for _ in range(tokens)],
            response_length=response,
            loss_mask=[1] * response,
            rollout_log_probs=[-rng.random() * 3 for _ in range(response)],
            advantage=rng.gauss(0, 1),
        )
        for _ in range(count)
    ]
    steps = [samples[i::4] for i in range(4)]
    return protocol.Request(1, protocol.TrainCommand(0, steps, [len(step) * response for step in steps]))


def reply(steps: int) -> protocol.Response:
    metrics = protocol.StepMetrics(0.5, 0.4, 512.0, 3.0, 90.0, 0.01, 2.5, 1024.0, 0.2, 1.1, 1e-6, 0.8,
                                   extra={"tis/mean": 0.9})
    return protocol.Response(1, True, protocol.TrainResult([metrics] * steps))


def best(repeats: int, work: Callable[[], Any]) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        work()
        times.append(time.perf_counter() - started)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, nargs="+", default=[32, 128, 512])
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    print(f"{'samples':>8} {'MB':>7} {'encode ms':>10} {'floor':>8} {'ratio':>6} {'decode ms':>10} {'floor':>8} {'ratio':>6}")
    for count in args.samples:
        request = shard(count, args.tokens)
        frame = protocol.encode_frame(request)
        body = frame[4:]
        plain = msgpack.unpackb(body)
        assert protocol.decode_body(body) == request
        encode = best(args.repeats, lambda: protocol.encode_frame(request))  # noqa: B023 - run at once
        encode_floor = best(args.repeats, lambda: msgpack.packb(plain))  # noqa: B023
        decode = best(args.repeats, lambda: protocol.decode_body(body))  # noqa: B023
        decode_floor = best(args.repeats, lambda: msgpack.unpackb(body))  # noqa: B023
        print(f"{count:>8} {len(frame) / 1e6:>7.2f} {encode * 1e3:>10.1f} {encode_floor * 1e3:>8.1f} "
              f"{encode / encode_floor:>6.2f} {decode * 1e3:>10.1f} {decode_floor * 1e3:>8.1f} "
              f"{decode / decode_floor:>6.2f}")
    print(f"\n{'steps':>8} {'KB':>7} {'encode µs':>10} {'floor':>8} {'ratio':>6} {'decode µs':>10} {'floor':>8} {'ratio':>6}")
    for steps in (1, 16, 256):
        response = reply(steps)
        frame = protocol.encode_frame(response)
        body = frame[4:]
        plain = msgpack.unpackb(body)
        assert protocol.decode_body(body) == response
        encode = best(args.repeats * 20, lambda: protocol.encode_frame(response))  # noqa: B023
        encode_floor = best(args.repeats * 20, lambda: msgpack.packb(plain))  # noqa: B023
        decode = best(args.repeats * 20, lambda: protocol.decode_body(body))  # noqa: B023
        decode_floor = best(args.repeats * 20, lambda: msgpack.unpackb(body))  # noqa: B023
        print(f"{steps:>8} {len(frame) / 1e3:>7.1f} {encode * 1e6:>10.1f} {encode_floor * 1e6:>8.1f} "
              f"{encode / encode_floor:>6.2f} {decode * 1e6:>10.1f} {decode_floor * 1e6:>8.1f} "
              f"{decode / decode_floor:>6.2f}")


if __name__ == "__main__":
    main()
