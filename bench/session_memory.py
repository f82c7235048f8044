"""Benchmark: a session server session's memory and per-turn time as its trajectory grows.

For T = 4, 16, 64, 256 turns (each: the engine writes `--output` tokens with logprobs, the agent appends a tool
message), measures the traced Python memory the session holds (tracemalloc) and the time to compute a turn's
prompt ids and record it. The floor, measured in the same run, is the data itself: the trajectory's token ids,
its messages and the engine's responses held in plain lists. A session that kept each turn's prompt ids (as a
record of every request does) would grow as turns x tokens; this one stays a constant factor over the floor.

    .venv/bin/python -m bench.session_memory [--output 64] [--turns 4 16 64 256]

About 20 CPU-seconds with the defaults (the tiny model's tokenizer is built first).
"""

from __future__ import annotations

import argparse
import gc
import tempfile
import time
import tracemalloc
from pathlib import Path
from typing import Any

from coordinator.sessions.tito import strict_matches, tito_tokenizer
from coordinator.sessions.trajectory import Session, assemble
from workers.tiny_model import build_tokenizer_files


def _response(output: list[int]) -> dict[str, Any]:
    pairs = [[-0.25, token, None] for token in output]
    return {"id": "x", "choices": [{"index": 0, "message": {"role": "assistant", "content": "y" * len(output)},
                                    "finish_reason": "stop", "meta_info": {"output_token_logprobs": pairs,
                                                                           "completion_tokens": len(output)}}]}


def run_session(tokenizer: Any, turns: int, output_len: int) -> tuple[Session, float, list[dict[str, Any]]]:
    """A session of `turns` turns; returns it, the seconds per turn and the conversation's messages."""
    tito = tito_tokenizer("qwen3", tokenizer)
    session = Session()
    messages: list[dict[str, Any]] = [{"role": "user", "content": "start"}]
    output = tokenizer.encode("ab" * (output_len // 2), add_special_tokens=False)
    elapsed = 0.0
    for index in range(turns):
        started = time.perf_counter()
        prompt, kept = session.prompt_ids(messages, None, tito, strict_matches)
        response = _response(output)
        session.record(kept=kept, prompt_ids=prompt, messages=list(messages), output_ids=list(output),
                       logprobs=[-0.25] * len(output), finish="stop", weight_version=str(index),
                       reply={"role": "assistant", "content": "y" * len(output)},
                       record={"request": {"max_tokens": output_len}, "response": response})
        elapsed += time.perf_counter() - started
        messages += [{"role": "assistant", "content": "y" * len(output)}, {"role": "tool", "content": "z" * 64}]
    return session, elapsed / turns, messages[:-1]


def traced(build: Any) -> tuple[Any, int]:
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    value = build()
    gc.collect()
    held = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    return value, held


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=int, default=64, help="tokens the engine writes per turn")
    parser.add_argument("--turns", type=int, nargs="+", default=[4, 16, 64, 256])
    options = parser.parse_args()
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory() as directory:
        build_tokenizer_files(Path(directory), max_length=1 << 20)
        tokenizer = AutoTokenizer.from_pretrained(directory)
    print(f"{'turns':>6} {'tokens':>8} {'session MiB':>12} {'floor MiB':>10} {'ratio':>6} {'ms/turn':>8}")
    for turns in options.turns:
        (session, per_turn, messages), held = traced(lambda t=turns: run_session(tokenizer, t, options.output))
        # The floor: the same token ids, messages and responses as plain data, nothing else.
        _, floor_bytes = traced(lambda t=turns, s=session, m=messages: _floor_data(s, t, m))
        assert assemble(session) is not None
        print(f"{turns:>6} {len(session.token_ids):>8} {held / 2**20:>12.2f} {floor_bytes / 2**20:>10.2f} "
              f"{held / floor_bytes:>6.2f} {per_turn * 1e3:>8.2f}")


def _floor_data(session: Session, turns: int, messages: list[dict[str, Any]]) -> list[Any]:
    output = list(session.turns[0].output_ids)
    return [list(session.token_ids), [dict(m) for m in messages], [_response(output) for _ in range(turns)]]


if __name__ == "__main__":
    main()
