"""Benchmark: the SFT rollout's tokenization (`coordinator.rollout.sft_mask`) as chats grow, against a floor.

For chats of T turns (user/assistant pairs, each message ~`--chars` characters), measures chats/s and tokens/s of
each `--loss-mask-type` rule beside the floor measured in the same run: one `apply_chat_template(tokenize=True)`
of the whole chat, which any SFT tokenization must at least do. Prints each rule's time as a ratio of the floor
for T = 1, 4, 16: `qwen` renders every message alone (ratio ~1, linear in the chat), `qwen3` renders each message
with a neighbour turn (~2), `qwen3_5` renders once and tokenizes once more with offsets (~2). Uses the tiny
model's character tokenizer (built locally), so tokens ≈ characters.

    .venv/bin/python -m bench.sft_mask [--chats 64] [--chars 200] [--turns 1 4 16]
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from collections.abc import Callable
from typing import Any

from coordinator.rollout.sft_mask import ChatLossMask
from workers.tiny_model import build_tiny_model

RULES = ("qwen", "qwen3", "qwen3_5", "distill_qwen")


def make_chats(count: int, turns: int, chars: int, seed: int = 0) -> list[list[dict[str, str]]]:
    rng = random.Random(seed)
    alphabet = "abcdefghijklmnopqrstuvwxyz "

    def text() -> str:
        return "".join(rng.choice(alphabet) for _ in range(chars))

    return [[{"role": role, "content": text()} for _ in range(turns) for role in ("user", "assistant")]
            for _ in range(count)]


def timed(fn: Callable[[Any], Any], chats: list[Any]) -> float:
    best = float("inf")
    for _ in range(3):
        started = time.perf_counter()
        for chat in chats:
            fn(chat)
        best = min(best, time.perf_counter() - started)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chats", type=int, default=64)
    parser.add_argument("--chars", type=int, default=200)
    parser.add_argument("--turns", type=int, nargs="+", default=[1, 4, 16])
    args = parser.parse_args()
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory() as directory:
        tokenizer = AutoTokenizer.from_pretrained(build_tiny_model(directory))
    rules = {name: ChatLossMask(tokenizer, name) for name in RULES}
    print(f"{'turns':>5} {'tokens/chat':>11} {'floor chats/s':>13} " + " ".join(f"{name:>13}" for name in RULES))
    for turns in args.turns:
        chats = make_chats(args.chats, turns, args.chars)
        tokens = sum(len(tokenizer.apply_chat_template(chat, tokenize=True, return_dict=False)) for chat in chats)
        floor = timed(lambda chat: tokenizer.apply_chat_template(chat, tokenize=True, return_dict=False), chats)
        ratios = [timed(rule, chats) / floor for rule in rules.values()]
        print(f"{turns:>5} {tokens // len(chats):>11} {len(chats) / floor:>13.0f} "
              + " ".join(f"{ratio:>12.2f}x" for ratio in ratios))


if __name__ == "__main__":
    main()
