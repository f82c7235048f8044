"""Benchmark: the start-up check of a whole prompt file, beside the floor of reading and decoding its lines.

Measures, in one run, for JSONL files of N lines (GSM8K-shaped records: a question of ~200 characters, an
answer, a small metadata object): the time of `coordinator.data.check.check_data_file` (every line decoded
through the boundary layer, keys and kinds checked) and its peak memory growth, beside two floors measured on
the same file — reading the lines alone, and reading them and decoding each with msgspec (no limits, no
checks). Time grows linearly in N; memory stays one line whatever N (the records are counted, not kept).

    .venv/bin/python -m bench.data_check [--lines 100000 1000000]

About 30 CPU-seconds with the defaults.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

from coordinator.data.check import RecordKeys, check_data_file
from tests.support.memory import PeakMemory

KEYS = RecordKeys(input_key="question", label_key="answer", metadata_key="metadata")


def write_file(path: Path, lines: int, seed: int = 0) -> Path:
    rng = random.Random(seed)
    words = ["apples", "trains", "miles", "each", "costs", "how", "many", "total", "if", "she", "buys", "per"]
    with path.open("w", encoding="utf-8") as handle:
        for index in range(lines):
            question = " ".join(rng.choice(words) for _ in range(36)) + "?"
            handle.write(json.dumps({"question": question, "answer": str(rng.randrange(10_000)),
                                     "metadata": {"source": "bench", "id": index}}) + "\n")
    return path


def timed(work: Callable[[], Any]) -> tuple[float, float, Any]:
    peak = PeakMemory()
    started = time.perf_counter()
    result = work()
    return time.perf_counter() - started, peak.growth_mib, result


def read_lines(path: Path) -> int:
    with path.open("rb") as handle:
        return sum(1 for _ in handle)


def decode_lines(path: Path) -> int:
    decode = msgspec.json.decode
    with path.open("rb") as handle:
        return sum(1 for line in handle if decode(line))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, nargs="+", default=[100_000, 1_000_000])
    args = parser.parse_args()
    print(f"{'lines':>9} {'MB':>7} {'check s':>8} {'µs/line':>8} {'MiB':>6} {'read s':>7} {'decode s':>9} "
          f"{'ratio':>6}")
    with tempfile.TemporaryDirectory() as directory:
        for count in args.lines:
            path = write_file(Path(directory) / f"{count}.jsonl", count)
            read_s, _, _ = timed(lambda: read_lines(path))  # noqa: B023 - called before the loop moves on
            decode_s, _, _ = timed(lambda: decode_lines(path))  # noqa: B023
            check_s, growth, records = timed(lambda: check_data_file(path, KEYS))  # noqa: B023
            assert records == count
            print(f"{count:>9} {path.stat().st_size / 1e6:>7.1f} {check_s:>8.2f} {check_s / count * 1e6:>8.2f} "
                  f"{growth:>6.1f} {read_s:>7.2f} {decode_s:>9.2f} {check_s / decode_s:>6.1f}")
            path.unlink()


if __name__ == "__main__":
    main()
