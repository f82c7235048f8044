"""The trainer at the shapes of a real RL job: 64 prompts × 8 samples with a long-tailed response length, on a
Qwen3-shaped model with Qwen3's 151,936-token vocabulary (issue 20).

Figures, each against a floor measured in the same run:
- the rank's peak memory over its whole train command (one optimizer step over the batch; `bench.shapes_parts.
  rank_process`) against the chunked floor: the same model and AdamW doing one forward + backward + step of the
  largest packed micro-batch (`floor_process`). Target ≤ 1.3×.
- real tokens as a fraction of computed tokens (packing; the old consecutive right-padded plan beside it).
  Target ≥ 0.95.
- attention pairs computed ÷ needed (each sample's own causal pairs), counted at the sdpa calls of one forward
  of every micro-batch (`shapes_parts.counting_pairs`); beside it what sdpa's row-wide block-diagonal mask
  (transformers' packed path) asks for. Target ≤ 1.05 (issue 38). `--pairs-only`: that figure alone, the
  attention counted but not computed, fast at the full shape.
- tokens/s of the train command against forward + backward alone on the same packed real tokens, same process
  and state. Target ≥ 0.8×. On CUDA also MFU (6 × parameters + attention FLOPs per token, against --peak-tflops).
- `--attention-paths per_sample,grouped,varlen`: forward + backward of the first `--attention-batches`
  micro-batches under each of `packed_sdpa`'s paths side by side (tokens/s, kernel calls per micro-batch, MFU on
  CUDA against prime-rl's published Qwen3-0.6B figure at 16k on one H100: 11.9k tokens/s, 11.1 % MFU). A report.
- the control channel: seconds and bytes to encode the batch's per-rank train commands and ship them over a
  loopback socket to `RankChannel` readers that decode them, against the same bytes raw over a loopback socket;
  and the coordinator's RSS growth while it holds the batch (samples → wire samples → frames).

- the vision-language case (`bench.shapes_vlm`, issue 33), in the same run: tokens/s and peak memory of a train
  command on a batch with images against the same token sequences as text, the image bytes per sample on the
  control channel, the language model's attention pairs computed ÷ needed. A report, no target; `--no-vlm` skips it.

- `--critic`: the same train command with PPO's critic (`--advantage-estimator ppo`: the value model's old
  values, GAE, its clipped value-loss step beside the policy's), its peak memory and time against the
  policy-only command's: what the critic costs. A report, no target.

    python -m bench.train_shapes --quick              # CPU, ~1-3 minutes on 2 cores
    python -m bench.train_shapes --quick --critic     # and the critic's memory and time
    python -m bench.train_shapes --pairs-only         # attention pairs at the default shape, ~1 minute
    python -m bench.train_shapes --device cuda --bf16 --hidden 1024 --layers 28 ...   # see bench/gpu_check.sh

Exit 0 when the four targets hold, 1 otherwise.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from bench.shapes_parts import (
    QWEN3_VOCAB,
    Shape,
    attention_paths_process,
    build_model,
    critic_rank_process,
    floor_process,
    lengths,
    pairs_process,
    rank_process,
    samples,
    shape_fields,
)
from bench.shapes_vlm import print_vlm, vlm_case


def rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def padded_plan_ratio(totals: list[int], budget: int) -> tuple[float, int]:
    """The plan before packing: consecutive samples right-padded to the longest while count × longest fits."""
    computed, batches, current, longest = 0, 0, 0, 0
    for length in totals:
        if current and max(longest, length) * (current + 1) > budget:
            computed += longest * current
            batches += 1
            current, longest = 0, 0
        current += 1
        longest = max(longest, length)
    computed += longest * current
    return sum(totals) / computed, batches + 1


def print_lengths(shape: Shape) -> list[int]:
    pairs = lengths(shape)
    responses = sorted(response for _, response in pairs)
    totals = [prompt + response for prompt, response in pairs]

    def pct(q: float) -> int:
        return responses[min(len(responses) - 1, int(q * len(responses)))]

    print(f"batch: {shape.prompts} prompts × {shape.samples_per_prompt} samples = {len(pairs)} samples, "
          f"{sum(totals):,} tokens; --max-tokens-per-gpu {shape.max_tokens_per_gpu}")
    print(f"  response lengths: min {responses[0]}, p10 {pct(0.1)}, median {pct(0.5)}, p90 {pct(0.9)}, "
          f"p99 {pct(0.99)}, max {responses[-1]} (cap {shape.response_cap}); "
          f"at the cap: {sum(r == shape.response_cap for r in responses)}")
    edges = [shape.response_cap * k // 8 for k in range(1, 9)]
    counts = [sum(1 for r in responses if (edges[i - 1] if i else 0) < r <= edge) for i, edge in enumerate(edges)]
    print("  histogram (upper edge: count): " + ", ".join(f"{e}: {c}" for e, c in zip(edges, counts, strict=True)))
    return totals


def run_child(target: Any, *args: Any) -> dict[str, Any]:
    context = multiprocessing.get_context("spawn")
    with context.Pool(1) as pool:
        return pool.apply(target, args)


def channel(shape: Shape, vocab_size: int, world_size: int) -> dict[str, float]:
    """Encode and ship the batch's per-rank train commands; the same bytes raw over a loopback socket."""
    from coordinator.train.planning import plan_steps
    from workers import protocol
    from workers.protocol.train_settings import BatchingSettings

    before = rss_bytes()
    batch = samples(shape, vocab_size)
    holding = rss_bytes()
    started = time.perf_counter()
    wire = [protocol.WireSample.from_sample(sample) for sample in batch]
    plan = plan_steps(wire, BatchingSettings(), world_size)
    frames = [protocol.encode_frame(protocol.Request(rank + 1, protocol.TrainCommand(
        0, [step.shards[rank] for step in plan], [step.loss_tokens for step in plan])), 2**40)
        for rank in range(world_size)]
    encode_s = time.perf_counter() - started
    peak_holding = rss_bytes()
    ship_s = _ship(frames, decode=True)
    floor_s = min(_ship(frames, decode=False) for _ in range(3))
    size = sum(len(frame) for frame in frames)
    tokens = sum(len(sample.tokens) for sample in batch)
    return {"bytes": size, "tokens": tokens, "encode_s": encode_s, "ship_s": ship_s, "floor_s": floor_s,
            "samples_rss": holding - before, "with_frames_rss": peak_holding - before}


def _ship(frames: list[bytes], *, decode: bool) -> float:
    """Seconds to send every frame over its own loopback connection until the reader has it (decoded by the
    rank's RankChannel, or read raw)."""
    from workers import protocol

    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    done: list[float] = []

    def reader(conn: socket.socket, size: int) -> None:
        if decode:
            message = protocol.RankChannel(conn, 2**40).receive()
            assert isinstance(message, protocol.Request)
        else:
            buffer, received = bytearray(size), 0
            view = memoryview(buffer)
            while received < size:
                received += conn.recv_into(view[received:], size - received)
        done.append(time.perf_counter())
        conn.close()

    senders = [socket.create_connection(("127.0.0.1", port)) for _ in frames]
    threads = []
    for frame in frames:
        conn, _ = listener.accept()
        threads.append(threading.Thread(target=reader, args=(conn, len(frame))))
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for sender, frame in zip(senders, frames, strict=True):
        sender.sendall(frame)
    for thread in threads:
        thread.join()
    for sender in senders:
        sender.close()
    listener.close()
    return max(done) - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a CPU-sized batch (short responses)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--attn", default=None, help="attn_implementation (flash_attention_2 on CUDA)")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--intermediate", type=int, default=192)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=None)
    parser.add_argument("--prompts", type=int, default=None, help="prompts in the batch (default 64)")
    parser.add_argument("--report-only", action="store_true", help="print the figures, exit 0 whatever they are")
    parser.add_argument("--channel-only", action="store_true", help="only the control channel (no model): fast at "
                        "the full shape on a CPU")
    parser.add_argument("--pairs-only", action="store_true", help="only the attention pairs computed ÷ needed "
                        "(attention counted, not computed): fast at the full shape on a CPU")
    parser.add_argument("--max-tokens-per-gpu", type=int, default=None)
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="device peak (H100/H200 bf16 dense)")
    parser.add_argument("--threads", type=int, default=max(1, min(2, os.cpu_count() or 1)))
    parser.add_argument("--attention-paths", default="", help="comma-separated packed_sdpa paths (per_sample, "
                        "grouped, varlen, auto) to compare on forward + backward; none by default")
    parser.add_argument("--attention-batches", type=int, default=8, help="micro-batches each path runs")
    parser.add_argument("--critic", action="store_true", help="also the train command with PPO's critic: its "
                        "memory and time against the policy-only command's")
    parser.add_argument("--no-vlm", action="store_true", help="skip the vision-language case")
    options = parser.parse_args()
    shape = (Shape(prompt_median=6, response_median=6, response_cap=48, max_tokens_per_gpu=256)
             if options.quick else Shape())
    if options.max_tokens_per_gpu:
        shape = Shape(**{**shape_fields(shape), "max_tokens_per_gpu": options.max_tokens_per_gpu})
    if options.prompts:
        shape = Shape(**{**shape_fields(shape), "prompts": options.prompts})
    totals = print_lengths(shape)
    if options.channel_only:
        print_channel(channel(shape, QWEN3_VOCAB, world_size=2))
        return
    if options.pairs_only:
        sys.exit(0 if print_pairs(options, shape) or options.report_only else 1)
    ratio_before, batches_before = padded_plan_ratio(totals, shape.max_tokens_per_gpu)
    dtype = "bfloat16" if options.bf16 else "float32"
    with tempfile.TemporaryDirectory() as work:
        model_dir = str(build_model(Path(work) / "model", hidden=options.hidden, layers=options.layers,
                                    intermediate=options.intermediate, heads=options.heads,
                                    kv_heads=options.kv_heads, vocab_size=QWEN3_VOCAB, head_dim=options.head_dim))
        args = (model_dir, shape_fields(shape), QWEN3_VOCAB, options.device, dtype, options.attn, options.threads)
        floor = run_child(floor_process, *args)
        rank = run_child(rank_process, *args)
        if options.critic:
            print_critic(rank, run_child(critic_rank_process, *args))
        if options.attention_paths:
            print_paths(options, run_child(attention_paths_process, *args[:5], options.attention_paths.split(","),
                                           options.attention_batches, options.threads))
    if not options.no_vlm:
        print_vlm(vlm_case(quick=options.quick, device=options.device, threads=options.threads))
    wire = channel(shape, QWEN3_VOCAB, world_size=2)
    report(options, shape, rank, floor, wire, ratio_before, batches_before)


def print_pairs(options: argparse.Namespace, shape: Shape) -> bool:
    """The attention pairs of the trainer's attention (--attn, default packed_sdpa) and of plain sdpa over the
    same packed micro-batches; True when the former is within 1.05× the needed pairs."""
    with tempfile.TemporaryDirectory() as work:
        model_dir = str(build_model(Path(work) / "model", hidden=options.hidden, layers=options.layers,
                                    intermediate=options.intermediate, heads=options.heads,
                                    kv_heads=options.kv_heads, vocab_size=QWEN3_VOCAB, head_dim=options.head_dim))
        ours = run_child(pairs_process, model_dir, shape_fields(shape), QWEN3_VOCAB, options.attn, options.threads)
        row = run_child(pairs_process, model_dir, shape_fields(shape), QWEN3_VOCAB, "sdpa", options.threads)
    ratio = ours["pairs"] / ours["needed"]
    print(f"attention pairs: {ours['attn']} computes {ratio:.3f}× the needed (each sample's causal pairs; "
          f"{ours['calls']} kernel calls; target ≤ 1.05); sdpa's row-wide mask: {row['pairs'] / row['needed']:.2f}× "
          f"({row['calls']} calls)")
    return ratio <= 1.05


def report(options: argparse.Namespace, shape: Shape, rank: dict[str, Any], floor: dict[str, Any],
           wire: dict[str, float], ratio_before: float, batches_before: int) -> None:
    gib = 2**30
    memory_ratio = rank["peak_bytes"] / floor["peak_bytes"]
    real_ratio = rank["real_tokens"] / rank["computed_tokens"]
    rate, floor_rate = rank["real_tokens"] / rank["train_s"], rank["real_tokens"] / rank["floor_s"]
    print(f"model: {rank['parameters'] / 1e6:.1f} M parameters (vocabulary {QWEN3_VOCAB:,}, hidden {options.hidden}, "
          f"{options.layers} layers), {'bfloat16' if options.bf16 else 'float32'} on {options.device}")
    print(f"memory: rank peak {rank['peak_bytes'] / gib:.2f} GiB over the train command vs chunked floor "
          f"{floor['peak_bytes'] / gib:.2f} GiB (one micro-batch of {floor['tokens']} tokens + AdamW step): "
          f"{memory_ratio:.2f}× (target ≤ 1.3×)")
    print(f"tokens: {rank['real_tokens']:,.0f} real of {rank['computed_tokens']:,} computed = {real_ratio:.3f} in "
          f"{rank['micro_batches']} packed micro-batches (target ≥ 0.95); consecutive right-padded plan: "
          f"{ratio_before:.3f} in {batches_before}")
    print(f"throughput: {rate:,.0f} tokens/s for the train command vs {floor_rate:,.0f} tokens/s forward + backward "
          f"alone: {rate / floor_rate:.2f}× (target ≥ 0.8×)")
    if options.device.startswith("cuda"):
        totals = [prompt + response for prompt, response in lengths(shape)]
        flops_per_token = flops_per_token_of(options, rank["parameters"], sum(t * t for t in totals) / sum(totals))
        print(f"MFU: {rate * flops_per_token / (options.peak_tflops * 1e12):.1%} of {options.peak_tflops:.0f} "
              f"TFLOP/s ({flops_per_token / 1e9:.2f} GFLOP per token)")
    pairs_ratio = rank["pairs"] / rank["needed_pairs"] if rank["attention_calls"] else None
    print("attention pairs: " + (f"{pairs_ratio:.3f}× the needed computed (each sample's causal pairs, "
                                 f"{rank['attention_calls']} sdpa calls per forward of the batch; target ≤ 1.05)"
                                 if pairs_ratio is not None else f"no sdpa calls ({options.attn}: not counted)"))
    print_channel(wire)
    ok = (memory_ratio <= 1.3 and real_ratio >= 0.95 and rate >= 0.8 * floor_rate
          and (pairs_ratio is None or pairs_ratio <= 1.05))
    print(("PASS" if ok else "FAIL") + (" (report only)" if options.report_only else ""))
    sys.exit(0 if ok or options.report_only else 1)


def flops_per_token_of(options: argparse.Namespace, parameters: int, sequence: float) -> float:
    """PaLM's count: 6 × parameters, plus attention 12 × layers × (heads × head_dim) × the sequence (each
    sample's own: attention stays within it; Σ L² / Σ L over the tokens counted)."""
    width = options.heads * (options.head_dim or options.hidden // options.heads)
    return 6 * parameters + 12 * options.layers * width * sequence


def print_paths(options: argparse.Namespace, result: dict[str, Any]) -> None:
    """packed_sdpa's paths side by side on the same micro-batches (forward + backward)."""
    cuda = options.device.startswith("cuda")
    flops = flops_per_token_of(options, result["parameters"], result["sequence"])
    print(f"packed attention paths: forward + backward of {result['micro_batches']} micro-batches "
          f"({result['tokens']:,} tokens)" + ("; prime-rl's published Qwen3-0.6B at 16k on one H100: 11.9k tokens/s, "
                                             "11.1 % MFU (a whole train step)" if cuda else ""))
    first = None
    for path, figures in result["paths"].items():
        if "refused" in figures:
            print(f"  {path}: not run here ({figures['refused']})")
            continue
        rate = result["tokens"] / figures["seconds"]
        first = first or rate
        print(f"  {path}: {figures['seconds']:.2f} s, {rate:,.0f} tokens/s ({rate / first:.2f}× the first), "
              f"{figures['calls']} kernel calls per micro-batch, pairs ÷ needed "
              f"{figures['pairs'] / result['needed_pairs']:.3f}"
              + (f", MFU {rate * flops / (options.peak_tflops * 1e12):.1%}" if cuda else ""))


def print_critic(rank: dict[str, Any], critic: dict[str, Any]) -> None:
    gib = 2**30
    print(f"critic (PPO): train command {critic['train_s']:.2f} s vs {rank['train_s']:.2f} s policy-only "
          f"({critic['train_s'] / rank['train_s']:.2f}×: old values, GAE, a value step beside the policy's); peak "
          f"{critic['peak_bytes'] / gib:.2f} GiB vs {rank['peak_bytes'] / gib:.2f} GiB "
          f"(+{(critic['peak_bytes'] - rank['peak_bytes']) / gib:.2f} GiB: the value model and its AdamW state)")


def print_channel(wire: dict[str, float]) -> None:
    print(f"control channel: {wire['bytes'] / 2**20:.1f} MiB for {wire['tokens']:,} tokens "
          f"({wire['bytes'] / wire['tokens']:.1f} B/token) to 2 ranks: encode {wire['encode_s']:.3f} s, ship + "
          f"decode {wire['ship_s']:.3f} s vs loopback floor {wire['floor_s']:.3f} s "
          f"({wire['ship_s'] / max(wire['floor_s'], 1e-9):.1f}×)")
    print(f"coordinator RSS: +{wire['samples_rss'] / 2**20:.1f} MiB holding the samples, "
          f"+{wire['with_frames_rss'] / 2**20:.1f} MiB with the wire samples and both ranks' frames "
          f"(frames {wire['bytes'] / 2**20:.1f} MiB: each sample is encoded once, for its rank)")


if __name__ == "__main__":
    main()
