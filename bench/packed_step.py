"""The rank's train step on packed rows against a bare single-process loop doing the same work, alternating in
one process (issue 38: 16 samples × 1,024 tokens on a Qwen3-shaped model, hidden 256, 4 layers, a 32k
vocabulary, 2 threads).

- the rank: `Trainer.train` of one step over the 16 samples (packed into rows of `--max-tokens-per-gpu`,
  the trainer's default attention, or `--attn`);
- the floor: the same model (its own copy, same weights) and AdamW, no packing: each micro-batch of the same
  samples as a plain [n, 1,024] batch (equal lengths, so no padding, plain causal sdpa), chunked logprobs
  and the entropy metric (`token_scores`, as the trainer: slime's policy loss always computes the entropy of
  the response tokens, detached unless `--entropy-coef`, and logs it as `entropy_loss`, so a loop without it
  would not be doing slime's step), a policy-gradient loss over the response tokens, backward, AdamW step.

Rounds alternate in ABBA order (rank, floor; floor, rank; ...) after one warm-up of each, so a load that
drifts during the run falls on both alike; the figure is the ratio of the medians, in wall seconds and in this process's CPU seconds (all its threads: on a machine other jobs load, the
work done rather than the share of the cores it got). Target ≤ 1.2× (wall). Also printed, not judged on: the
median of the rounds' own wall ratios (each round's two steps are adjacent, so they share its load) and the
1-minute load average per round, before and after; per step the system CPU seconds, page faults and involuntary
context switches (getrusage), which say whether an outlying step did more work or got less of the cores.

    python -m bench.packed_step [--rounds 3] [--attn sdpa] [--path per_sample]   # CPU, ~2-5 minutes on 2 cores

Exit 0 when the target holds (or with --report-only).
"""

from __future__ import annotations

import argparse
import os
import random
import resource
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from bench.shapes_parts import build_model
from tests.support.train_settings import init_command
from workers import protocol

VOCAB = 32_768


def _samples(count: int, length: int, prompt: int) -> list[protocol.WireSample]:
    rng = random.Random(0)
    response = length - prompt
    return [protocol.WireSample(tokens=[rng.randrange(VOCAB) for _ in range(length)], response_length=response,
                                loss_mask=[1] * response, rollout_log_probs=[-10.4] * response,
                                advantage=rng.choice((-1.0, 1.0)))
            for _ in range(count)]


class BareLoop:
    """The floor: forward, chunked logprobs and entropy metric, a PPO-style loss, backward and AdamW on plain
    [n, L] batches."""

    def __init__(self, model_dir: str, samples: list[protocol.WireSample], per_batch: int) -> None:
        from workers.train_rank.model import load_causal_lm
        from workers.train_rank.optim import build_optimizer

        self.model = load_causal_lm(model_dir, dtype=torch.float32, device=torch.device("cpu"),
                                    attn_implementation="sdpa")
        self.optimizer = build_optimizer(self.model, lr=1e-6, weight_decay=0.0, betas=(0.9, 0.999), eps=1e-8)
        self.batches = []
        for start in range(0, len(samples), per_batch):
            group = samples[start : start + per_batch]
            input_ids = torch.tensor([sample.tokens for sample in group])
            mask = torch.zeros(input_ids.shape[0], input_ids.shape[1] - 1)
            mask[:, -group[0].response_length :] = 1.0
            advantages = torch.tensor([sample.advantage for sample in group]).unsqueeze(1) * mask
            self.batches.append((input_ids, mask, advantages))
        self.tokens = sum(float(mask.sum()) for _, mask, _ in self.batches)
        self.entropy_sum = 0.0

    def step(self) -> None:
        from workers.shared_torch.token_scores import token_scores

        self.optimizer.zero_grad(set_to_none=True)
        self.entropy_sum = 0.0
        for input_ids, mask, advantages in self.batches:
            log_probs, entropy = token_scores(self.model, input_ids=input_ids, scored=mask.bool())
            assert entropy is not None
            self.entropy_sum += float((entropy * mask).sum())
            ratio = torch.exp(log_probs - log_probs.detach())
            (-(ratio * advantages).sum() / self.tokens).backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--max-tokens-per-gpu", type=int, default=8192)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--attn", default=None, help="the rank's attn_implementation (default: the trainer's)")
    parser.add_argument("--path", default=None, choices=["auto", "varlen", "grouped", "per_sample"],
                        help="packed_sdpa's path for a packed row (RAYLESS_PACKED_ATTENTION; default auto: grouped "
                             "on CPU)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--report-only", action="store_true")
    options = parser.parse_args()
    torch.set_num_threads(options.threads)
    if options.path:
        os.environ["RAYLESS_PACKED_ATTENTION"] = options.path
    from workers.train_rank.trainer import Trainer

    samples = _samples(options.samples, options.length, options.prompt)
    per_batch = max(1, options.max_tokens_per_gpu // options.length)
    loss_tokens = sum(len(sample.loss_mask) for sample in samples)
    with tempfile.TemporaryDirectory() as work:
        model_dir = str(build_model(Path(work) / "model", hidden=options.hidden, layers=options.layers,
                                    intermediate=3 * options.hidden, heads=4, kv_heads=2, vocab_size=VOCAB))
        trainer = Trainer(rank=0, world_size=1, device=torch.device("cpu"))
        trainer.init(init_command({"model_path": model_dir, "lr": 1e-6, "dtype": "float32",
                                   "max_tokens_per_micro_batch": options.max_tokens_per_gpu,
                                   "attn_implementation": options.attn, "data_parallel": "replicate"}))
        bare = BareLoop(model_dir, samples, per_batch)

    def rank_step() -> None:
        trainer.train(protocol.TrainCommand(0, [samples], [loss_tokens]))

    def timed(step: Callable[[], None]) -> tuple[float, float, str]:
        """Wall and CPU seconds, and what the kernel says of the step: system CPU seconds, page faults, and the
        times the process was switched out involuntarily (the other jobs' share of the cores)."""
        before = resource.getrusage(resource.RUSAGE_SELF)
        wall, cpu = time.perf_counter(), time.process_time()
        step()
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        after = resource.getrusage(resource.RUSAGE_SELF)
        return wall, cpu, (f"sys {after.ru_stime - before.ru_stime:.1f} s, {after.ru_minflt - before.ru_minflt:,} "
                           f"faults, {after.ru_nivcsw - before.ru_nivcsw:,} preempted")

    attn = trainer.model.config._attn_implementation
    if attn == "packed_sdpa":
        attn += f" ({os.environ.get('RAYLESS_PACKED_ATTENTION', 'auto')} path)"
    print(f"{options.samples} samples × {options.length} tokens, hidden {options.hidden}, {options.layers} layers, "
          f"vocabulary {VOCAB:,}, {options.threads} threads; rank: {attn}, rows of ≤ {options.max_tokens_per_gpu} "
          f"tokens; floor: [{per_batch}, {options.length}] batches, sdpa causal, entropy metric as the rank", flush=True)
    load_before = os.getloadavg()[0]
    rank_step()  # warm-up
    bare.step()
    ranks: list[tuple[float, float, str]] = []
    floors: list[tuple[float, float, str]] = []
    for round_index in range(options.rounds):
        if round_index % 2:
            floors.append(timed(bare.step))
            ranks.append(timed(rank_step))
        else:
            ranks.append(timed(rank_step))
            floors.append(timed(bare.step))
        print(f"  round {round_index + 1}: rank {ranks[-1][0]:.2f} s ({ranks[-1][1]:.2f} CPU-s; {ranks[-1][2]}), bare "
              f"loop {floors[-1][0]:.2f} s ({floors[-1][1]:.2f} CPU-s; {floors[-1][2]}): "
              f"{ranks[-1][0] / floors[-1][0]:.2f}×; load {os.getloadavg()[0]:.1f}", flush=True)
    wall = [statistics.median(times[0] for times in runs) for runs in (ranks, floors)]
    cpu = [statistics.median(times[1] for times in runs) for runs in (ranks, floors)]
    # Beside the verdict (the ratio of the medians), the median of the rounds' own ratios: each pairs two
    # adjacent steps, so a load that changes between rounds (a step takes 12 s quiet, 35 s loaded here) does not
    # pair one side's quiet round with the other's loaded one. Reported, not judged on.
    per_round = statistics.median(rank[0] / floor[0] for rank, floor in zip(ranks, floors, strict=True))
    ok = wall[0] / wall[1] <= 1.2
    print(f"step: rank median {wall[0]:.2f} s vs bare loop {wall[1]:.2f} s: {wall[0] / wall[1]:.2f}× (target ≤ 1.2×) "
          f"{'PASS' if ok else 'FAIL'}" + (" (report only)" if options.report_only else "")
          + f"; CPU seconds {cpu[0]:.2f} vs {cpu[1]:.2f}: {cpu[0] / cpu[1]:.2f}×; median of the rounds' wall "
          f"ratios {per_round:.2f}×; load (1 min) {load_before:.1f} → {os.getloadavg()[0]:.1f}")
    sys.exit(0 if ok or options.report_only else 1)


if __name__ == "__main__":
    main()
