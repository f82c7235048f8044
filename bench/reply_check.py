"""Benchmark: the cost of checking a `/generate` reply, beside decoding it alone, in the same run.

For SGLang-shaped replies of T generated tokens (output ids, one `[logprob, id, null]` triple per token, SGLang's
meta fields), measures the best of R runs of: the floor — `msgspec.json.decode` of the bytes, building plain
values and checking nothing; the boundary decode (`coordinator.engines.bounded.decode_reply`: size, element
count and depth bounded); decode + `check_generate_reply` (ids ints in the vocabulary, logprobs finite, as
many as the ids and naming the same ids, finish reason of SGLang's set), the generic path; and the typed read
(`reply_decode.read_generate_answer`, what `EngineAPI.generate` uses: the same verdict, types checked by
msgspec in C). All grow linearly in T.

    .venv/bin/python -m bench.reply_check [--tokens 128 2048 32768] [--repeats 7]

About 5 CPU-seconds with the defaults.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import msgspec

from coordinator.engines.bounded import decode_reply, generate_reply_limit, limits_for
from coordinator.engines.replies import ReplyRules, check_generate_reply
from coordinator.engines.reply_decode import read_generate_answer_async

VOCAB = 151_936
URL = "http://127.0.0.1:30000"


def reply_bytes(tokens: int, seed: int = 0) -> bytes:
    rng = random.Random(seed)
    ids = [rng.randrange(VOCAB) for _ in range(tokens)]
    meta = {"id": "0123456789abcdef", "finish_reason": {"type": "length", "length": tokens}, "prompt_tokens": 64,
            "completion_tokens": tokens, "cached_tokens": 0, "weight_version": "3", "e2e_latency": 1.25,
            "output_token_logprobs": [[-rng.random() * 5, token, None] for token in ids]}
    return json.dumps({"text": "x" * (4 * tokens), "output_ids": ids, "meta_info": meta}).encode()


async def best(fn: Callable[[], Awaitable[Any]], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        await fn()
        times.append(time.perf_counter() - start)
    return min(times)


async def measure(tokens: int, repeats: int) -> dict[str, float]:
    """One event loop for all three, as in the coordinator (a large reply decodes in a worker thread)."""
    data = reply_bytes(tokens)
    cap = generate_reply_limit({"input_ids": [1] * 64, "sampling_params": {"max_new_tokens": tokens}})
    rules = ReplyRules(vocab_size=VOCAB, logprobs=True, expect_tokens=True)

    async def plain() -> Any:
        return msgspec.json.decode(data)

    async def boundary() -> Any:
        return await decode_reply(data, URL, cap)

    async def checked() -> Any:
        return check_generate_reply(await decode_reply(data, URL, cap), URL, rules)

    async def typed() -> Any:
        return await read_generate_answer_async(data, URL, payload, VOCAB, limits_for(cap))

    payload = {"input_ids": [1] * 64, "return_logprob": True, "sampling_params": {"max_new_tokens": tokens}}
    floor = await best(plain, repeats)
    bounded = await best(boundary, repeats)
    full = await best(checked, repeats)
    fast = await best(typed, repeats)
    return {"tokens": tokens, "bytes": len(data), "floor_ms": floor * 1e3, "bounded_ms": bounded * 1e3,
            "checked_ms": full * 1e3, "check_only_ms": (full - bounded) * 1e3, "ratio": full / floor,
            "typed_ms": fast * 1e3, "typed_ratio": fast / floor}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[128, 2048, 32768])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    print(f"{'tokens':>7} {'bytes':>10} {'decode (floor) ms':>18} {'bounded ms':>11} {'+ check ms':>11} "
          f"{'check alone ms':>15} {'checked / floor':>16} {'typed read ms':>14} {'typed / floor':>14}")
    for tokens in args.tokens:
        row = anyio.run(measure, tokens, args.repeats)
        print(f"{row['tokens']:>7} {row['bytes']:>10} {row['floor_ms']:>18.2f} {row['bounded_ms']:>11.2f} "
              f"{row['checked_ms']:>11.2f} {row['check_only_ms']:>15.2f} {row['ratio']:>16.2f} "
              f"{row['typed_ms']:>14.2f} {row['typed_ratio']:>14.2f}")


if __name__ == "__main__":
    main()
