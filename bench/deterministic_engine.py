"""What deterministic inference costs our engine: batch-invariant decoding and true-on-policy rescoring, each
against a floor measured in the same run.

Owns nothing but its measurement, in-process on the model runner (no HTTP), on a generated model:
- decode: B sequences decoded T steps by the batched runner (the floor) and by the batch-invariant runner,
  which runs one forward per sequence per step; the expected cost grows as B, so the figure is the ratio
  against B single-sequence steps (target <= --max-invariant-ratio: no cost beyond running them one by one);
- rescoring: one full forward of each finished sequence (prompt + output) by the trainer's scoring function,
  against the time its generation took (target <= --max-rescore-ratio of it);
- the bits: the batch-invariant runner's logprobs of sequence 0 equal its logprobs when decoded alone.

    .venv/bin/python -m bench.deterministic_engine [--hidden-size 256] [--layers 4] [--batch 1 4 16] [--steps 32]

Exit code 0 when every target holds, 1 otherwise.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from workers.engine.batch_invariant import BatchInvariantRunner
from workers.engine.rescoring import Rescorer
from workers.engine.runner import ModelRunner, PrefillItem
from workers.engine.sampling import RowSampling
from workers.tiny_model import TinyModelSpec, build_tiny_model


def rows(count: int) -> dict[str, RowSampling]:
    return {f"s{i}": RowSampling(temperature=1.0, top_p=1.0, top_k=0, min_p=0.0,
                                 generator=torch.Generator().manual_seed(i)) for i in range(count)}


def decode(runner: ModelRunner, count: int, steps: int, prompt_len: int) -> tuple[float, dict[str, list[int]],
                                                                                   list[float]]:
    """Seconds for `steps` decode steps of `count` sequences; their tokens; sequence 0's logprobs."""
    sampling = rows(count)
    prompts = [PrefillItem(key, [(7 * i + j) % 50 + 1 for j in range(prompt_len + i)], row)
               for i, (key, row) in enumerate(sampling.items())]
    first = runner.step(drop=[], prefills=prompts, decode=None)
    tokens = {key: [out.sample.token] for key, out in first.items()}
    logprobs = [first["s0"].sample.logprob]
    started = time.perf_counter()
    for _ in range(steps):
        out = runner.step(drop=[], prefills=[], decode=sampling)
        for key, result in out.items():
            tokens[key].append(result.sample.token)
        logprobs.append(out["s0"].sample.logprob)
    elapsed = time.perf_counter() - started
    runner.reset()
    return elapsed, tokens, logprobs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--max-invariant-ratio", type=float, default=1.5)
    parser.add_argument("--max-rescore-ratio", type=float, default=0.5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    spec = TinyModelSpec(hidden_size=args.hidden_size, num_hidden_layers=args.layers,
                         intermediate_size=4 * args.hidden_size, num_attention_heads=4, num_key_value_heads=2)
    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_model(Path(tmp), spec)
        batched, invariant = ModelRunner(str(model)), BatchInvariantRunner(str(model))
        rescorer = Rescorer(invariant)
        ok = True
        decode(batched, 1, 4, args.prompt_len)  # warm-up: lazy initialisation out of the first figure
        decode(invariant, 1, 4, args.prompt_len)
        single, _, alone = decode(invariant, 1, args.steps, args.prompt_len)
        for count in args.batch:
            floor, _, _ = decode(batched, count, args.steps, args.prompt_len)
            cost, tokens, logprobs = decode(invariant, count, args.steps, args.prompt_len)
            ratio = cost / (count * single)
            started = time.perf_counter()
            for i, key in enumerate(sorted(tokens)):
                prompt = [(7 * i + j) % 50 + 1 for j in range(args.prompt_len + i)]
                rescorer.score(prompt, tokens[key])
            rescore = (time.perf_counter() - started) / cost
            same = logprobs == alone
            print(f"B={count:3d}  batched {count * args.steps / floor:8.1f} tok/s  invariant "
                  f"{count * args.steps / cost:8.1f} tok/s ({cost / floor:5.2f}x the batched floor; "
                  f"{ratio:4.2f}x B single steps)  rescoring {rescore:4.2f}x the decode time  "
                  f"sequence 0 bit-equal to alone: {same}")
            ok = ok and same and ratio <= args.max_invariant_ratio and rescore <= args.max_rescore_ratio
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
