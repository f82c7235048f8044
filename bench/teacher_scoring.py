"""On-policy distillation's `sglang` teacher cost beside generating the same samples, in one run.

One CPU engine serves the tiny model. For each size N, N samples are generated (prompts of `--prompt-len`
tokens, `--response-len` tokens each, through the engine client at `--concurrency`): that time is the floor. The
same samples are then scored by `TeacherScorer` (one prefill each, `max_new_tokens: 0`), as the coordinator
does after a rollout. Prints, per N: the generation time, the scoring time, their ratio, and the bytes the
teacher logprobs add per sample. Usage: python -m bench.teacher_scoring [--sizes 64 256] [--concurrency 32]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path
from tempfile import TemporaryDirectory

import anyio

from coordinator.engines.client import EngineClient
from coordinator.rollout.teacher import TeacherScorer
from replay.sample import Sample, SampleStatus


async def generate(client: EngineClient, url: str, prompts: list[list[int]], response_len: int,
                   concurrency: int) -> list[Sample]:
    limit = anyio.CapacityLimiter(concurrency)
    samples: list[Sample] = []

    async def one(index: int, prompt: list[int]) -> None:
        async with limit:
            answer = await client.engine(url).generate({
                "input_ids": prompt, "return_logprob": True,
                "sampling_params": {"max_new_tokens": response_len, "min_new_tokens": response_len,
                                    "temperature": 1.0}})
        (reply,) = answer.replies
        output = list(reply.output_ids)
        logprobs = list(reply.logprobs or ())
        samples.append(Sample(sample_index=index, tokens=[*prompt, *output], response_length=len(output),
                              loss_mask=[1] * len(output), rollout_log_probs=logprobs,
                              status=SampleStatus.COMPLETED))

    async with anyio.create_task_group() as group:
        for index, prompt in enumerate(prompts):
            group.start_soon(one, index, prompt)
    return samples


async def measure(url: str, args: argparse.Namespace) -> None:
    rng = random.Random(0)
    async with EngineClient(max_connections=args.concurrency) as client:
        for size in args.sizes:
            prompts = [[rng.randrange(10, 40) for _ in range(args.prompt_len)] for _ in range(size)]
            started = time.perf_counter()
            samples = await generate(client, url, prompts, args.response_len, args.concurrency)
            generated = time.perf_counter() - started
            scorer = TeacherScorer(client, {"default": url}, concurrency=args.concurrency)
            started = time.perf_counter()
            await scorer.score(samples)
            scored = time.perf_counter() - started
            assert all(len(s.teacher_log_probs or ()) == s.response_length for s in samples)
            extra = sum(8 * len(s.teacher_log_probs or ()) for s in samples) / size
            print(f"N={size:5d}  generate {generated:7.2f} s  teacher {scored:7.2f} s  "
                  f"ratio {scored / generated:5.2f}  +{extra:.0f} B/sample in a dump")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--response-len", type=int, default=32)
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.support.engine_proc import start_engine_process
    from workers.tiny_model import build_tiny_model

    with TemporaryDirectory() as directory:
        model = build_tiny_model(Path(directory) / "model")
        with start_engine_process(model) as engine:
            anyio.run(measure, engine.url, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
