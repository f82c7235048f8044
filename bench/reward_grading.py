"""Benchmark: the cost of each math grader per sample, beside `exact_match` (the floor) in the same run.

Measures, on the math rows of tests/data/reward_corpus.jsonl (their responses and labels): microseconds per
sample for `exact_match` (a string comparison: the floor), slime's `math` (MATH form, then the symbolic form,
sympy only when both fail), `math_lenient` (ours), `math_verify` (Hugging Face's, when installed); then `math`
on one right answer after a reasoning text of growing length (1k, 10k, 100k, 1M characters), to show the cost
grows linearly with the response (one `rfind` and one brace scan) and not with what the reasoning contains.

    .venv/bin/python -m bench.reward_grading [--repeat 3]

About 20 CPU-seconds with the defaults (math_verify dominates).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import time
from pathlib import Path
from typing import Any

from coordinator.rewards.rules import apply_rule
from replay.sample import Sample, SampleStatus

CORPUS = Path(__file__).resolve().parents[1] / "tests" / "data" / "reward_corpus.jsonl"


def _sample(response: str, label: Any) -> Sample:
    return Sample(group_index=0, sample_index=0, prompt="q", tokens=[1], response_length=0, loss_mask=[],
                  rollout_log_probs=[], status=SampleStatus.COMPLETED, label=label, response=response)


def per_sample_us(rm_type: str, samples: list[Sample], repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        for sample in samples:
            apply_rule(rm_type, sample)
        best = min(best, time.perf_counter() - start)
    return best / len(samples) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=3)
    options = parser.parse_args()
    rows = [json.loads(line) for line in CORPUS.read_text(encoding="utf-8").splitlines()]
    samples = [_sample(row["response"], str(row["label"])) for row in rows if row["rm_type"] == "math"]
    types = ["exact_match", "math", "math_lenient"]
    if importlib.util.find_spec("math_verify") is not None:
        types.append("math_verify")
    for rm_type in types:
        apply_rule(rm_type, samples[0])  # imports (sympy, Math-Verify) are not per-sample costs
    floor = per_sample_us("exact_match", samples, options.repeat)
    print(f"{len(samples)} math rows of the corpus, best of {options.repeat}:")
    for rm_type in types:
        cost = per_sample_us(rm_type, samples, options.repeat)
        print(f"  {rm_type:<13} {cost:>10.1f} us/sample  ({cost / floor:>7.1f} x exact_match)")
    print("math on one right answer after a reasoning text of growing length:")
    for length in (1_000, 10_000, 100_000, 1_000_000):
        text = ("Let x be 12, so 2x = 24 {and} \\frac{a}{b}. " * (length // 40 + 1))[:length]
        sample = _sample(text + r" so \boxed{\frac{1}{2}}", "0.5")
        assert apply_rule("math", sample) == 1.0
        print(f"  {length:>9,} chars  {per_sample_us('math', [sample], options.repeat):>10.1f} us/sample")


if __name__ == "__main__":
    main()
