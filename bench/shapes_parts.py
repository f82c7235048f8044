"""The pieces of `bench.train_shapes`: the batch (long-tailed lengths), the model directory, and the measured
processes (the rank's train command, its same-run floors), each in a fresh spawned process so its peak memory
is its own.

Owns nothing but measurement. A child regenerates the batch from its parameters (nothing is pickled across
but plain numbers and dicts). Memory is the process's peak RSS (VmHWM) on CPU, `max_memory_allocated` on CUDA.
"""

from __future__ import annotations

import itertools
import random
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from replay.sample import Sample, SampleStatus
from tests.support.train_settings import init_command

QWEN3_VOCAB = 151_936


@dataclass(frozen=True)
class Shape:
    prompts: int = 64
    samples_per_prompt: int = 8
    prompt_median: int = 256
    response_median: int = 1536
    response_cap: int = 8192
    max_tokens_per_gpu: int = 8192
    seed: int = 0


def lengths(shape: Shape) -> list[tuple[int, int]]:
    """(prompt, response) tokens per sample: a prompt per group, lognormal responses capped (a long tail)."""
    rng = random.Random(shape.seed)
    out = []
    for _ in range(shape.prompts):
        prompt = max(4, min(4 * shape.prompt_median, int(rng.lognormvariate(0, 0.5) * shape.prompt_median)))
        for _ in range(shape.samples_per_prompt):
            response = int(rng.lognormvariate(0, 0.9) * shape.response_median)
            out.append((prompt, max(1, min(shape.response_cap, response))))
    return out


def samples(shape: Shape, vocab_size: int) -> list[Sample]:
    rng = random.Random(shape.seed + 1)
    batch = []
    for index, (prompt, response) in enumerate(lengths(shape)):
        tokens = [rng.randrange(vocab_size) for _ in range(prompt + response)]
        batch.append(Sample(group_index=index // shape.samples_per_prompt,
                            sample_index=index % shape.samples_per_prompt, tokens=tokens, response_length=response,
                            loss_mask=[1] * response, rollout_log_probs=[-11.9] * response, reward=1.0,
                            status=SampleStatus.COMPLETED, advantage=rng.choice((-1.0, 1.0))))
    return batch


def build_model(directory: Path, *, hidden: int, layers: int, intermediate: int, heads: int, kv_heads: int,
                vocab_size: int, head_dim: int | None = None) -> Path:
    from workers.tiny_model import TinyModelSpec, build_tiny_model

    return build_tiny_model(directory, TinyModelSpec(hidden_size=hidden, num_hidden_layers=layers,
                                                     intermediate_size=intermediate, num_attention_heads=heads,
                                                     num_key_value_heads=kv_heads, vocab_size=vocab_size,
                                                     head_dim=head_dim, max_position_embeddings=40_960))


def _peak_bytes(device: Any) -> int:
    import torch

    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/self/status has no VmHWM")


def _sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _wire(shape: Shape, vocab_size: int) -> list[Any]:
    from workers.protocol import WireSample

    return [WireSample.from_sample(sample) for sample in samples(shape, vocab_size)]


def _settings(model_dir: str, shape: Shape, dtype: str, attn: str | None) -> dict[str, Any]:
    return {"model_path": model_dir, "lr": 1e-5, "max_tokens_per_micro_batch": shape.max_tokens_per_gpu,
            "dtype": dtype, "attn_implementation": attn, "data_parallel": "replicate"}


@contextmanager
def counting_pairs(*, compute: bool = True) -> Iterator[list[int]]:
    """[pairs, calls] the attention kernel is asked for, per head, while inside: every sdpa call counted (a
    causal call without a mask q(q+1)/2, a masked one q × k: the kernel computes every pair it is given, a mask
    only zeroes some), and every varlen call (`packed_sdpa`'s CUDA path: each sequence's causal pairs).
    `compute=False`: the call returns zeros instead of attending (counting a big shape fast)."""
    import torch
    from torch.nn.attention import varlen

    sdpa, varlen_attn = torch.nn.functional.scaled_dot_product_attention, varlen.varlen_attn
    totals = [0, 0]

    def counting(query: Any, key: Any, value: Any, attn_mask: Any = None, dropout_p: float = 0.0,
                 is_causal: bool = False, **kwargs: Any) -> Any:
        q, k, rows = query.shape[-2], key.shape[-2], query.shape[0]
        totals[0] += rows * (q * (q + 1) // 2 if is_causal and attn_mask is None and q == k else q * k)
        totals[1] += 1
        if not compute:
            return query.new_zeros((*query.shape[:-1], value.shape[-1]))
        return sdpa(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, **kwargs)

    def counting_varlen(query: Any, key: Any, value: Any, cu_seq_q: Any, cu_seq_k: Any, max_q: int, max_k: int,
                        **kwargs: Any) -> Any:
        bounds = cu_seq_q.tolist()
        causal = tuple(kwargs.get("window_size", (-1, -1))) == (-1, 0)
        sizes = [end - start for start, end in itertools.pairwise(bounds)]
        totals[0] += sum(n * (n + 1) // 2 if causal else n * n for n in sizes)
        totals[1] += 1
        if not compute:
            return query.new_zeros((*query.shape[:-1], value.shape[-1]))
        return varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, **kwargs)

    torch.nn.functional.scaled_dot_product_attention = counting
    varlen.varlen_attn = counting_varlen
    try:
        yield totals
    finally:
        torch.nn.functional.scaled_dot_product_attention = sdpa
        varlen.varlen_attn = varlen_attn


def needed_pairs(batches: list[Any], layers: int) -> int:
    """Causal pairs within each sample, per head, over one forward of every micro-batch: Σ L(L+1)/2 × layers."""
    return layers * sum(n * (n + 1) // 2 for batch in batches for n in batch.total_lengths)


def pairs_process(model_dir: str, shape_fields: dict[str, Any], vocab_size: int, attn: str | None,
                  threads: int) -> dict[str, Any]:
    """Attention pairs asked of the kernel over one forward (the decoder, no head) of every packed micro-batch,
    attention itself not computed (`counting_pairs(compute=False)`): fast at the full shape on a CPU."""
    import torch

    from workers.train_rank import packing
    from workers.train_rank.model import load_causal_lm

    torch.set_num_threads(threads)
    shape = Shape(**shape_fields)
    wire = _wire(shape, vocab_size)
    model = load_causal_lm(model_dir, dtype=torch.float32, device=torch.device("cpu"), attn_implementation=attn,
                           trainable=False)
    groups = packing.plan(wire, max_tokens=shape.max_tokens_per_gpu, micro_batch_size=None)
    batches = [packing.pack([wire[i] for i in group], 0) for group in groups]
    with torch.no_grad(), counting_pairs(compute=False) as pairs:
        for batch in batches:
            model.model(input_ids=batch.input_ids, position_ids=batch.position_ids)
    return {"pairs": pairs[0], "calls": pairs[1], "needed": needed_pairs(batches, model.config.num_hidden_layers),
            "attn": model.config._attn_implementation}


def _forward_backward(model: Any, batches: list[Any]) -> float:
    """The floor's work: forward (chunked logprobs of the responses, as the trainer computes them) + backward on
    each packed micro-batch; seconds."""
    from workers.shared_torch.token_scores import token_scores

    started = time.perf_counter()
    for batch in batches:
        log_probs, _ = token_scores(model, input_ids=batch.input_ids, position_ids=batch.position_ids,
                                    with_entropy=False, scored=batch.response_positions())
        log_probs.sum().backward()
        model.zero_grad(set_to_none=True)
    return time.perf_counter() - started


def attention_paths_process(model_dir: str, shape_fields: dict[str, Any], vocab_size: int, device_name: str,
                            dtype: str, paths: list[str], micro_batches: int, threads: int) -> dict[str, Any]:
    """Forward (chunked logprobs) + backward of the first `micro_batches` packed micro-batches under each of
    `packed_sdpa`'s paths (`RAYLESS_PACKED_ATTENTION`), one model, same process: seconds, kernel calls per
    forward, and the attention pairs computed; a path this machine cannot run is reported with its reason."""
    import os

    import torch

    from workers.train_rank import packing
    from workers.train_rank.model import load_causal_lm

    torch.set_num_threads(threads)
    device = torch.device(device_name)
    shape = Shape(**shape_fields)
    wire = _wire(shape, vocab_size)
    model = load_causal_lm(model_dir, dtype=getattr(torch, dtype), device=device)
    groups = packing.plan(wire, max_tokens=shape.max_tokens_per_gpu, micro_batch_size=None)[:micro_batches]
    batches = [packing.pack([wire[i] for i in group], 0).to(device) for group in groups]
    totals = [n for batch in batches for n in batch.total_lengths]
    result: dict[str, Any] = {"tokens": sum(totals), "micro_batches": len(batches), "paths": {},
                              "sequence": sum(n * n for n in totals) / sum(totals),
                              "parameters": sum(p.numel() for p in model.parameters()),
                              "needed_pairs": needed_pairs(batches, model.config.num_hidden_layers)}
    for path in paths:
        os.environ["RAYLESS_PACKED_ATTENTION"] = path
        try:
            _forward_backward(model, batches[:1])  # warm-up (and the path's refusal, where it cannot run)
        except RuntimeError as exc:
            result["paths"][path] = {"refused": str(exc)}
            continue
        _sync(device)
        with counting_pairs() as pairs:
            seconds = _forward_backward(model, batches)
            _sync(device)
        result["paths"][path] = {"seconds": seconds, "calls": pairs[1] // len(batches), "pairs": pairs[0]}
    os.environ.pop("RAYLESS_PACKED_ATTENTION", None)
    return result


def critic_rank_process(*args: Any) -> dict[str, Any]:
    """`rank_process` with PPO's critic (`--advantage-estimator ppo`): its old values, GAE and value step too."""
    return rank_process(*args, critic=True)


def rank_process(model_dir: str, shape_fields: dict[str, Any], vocab_size: int, device_name: str, dtype: str,
                 attn: str | None, threads: int, critic: bool = False) -> dict[str, Any]:
    """The rank's whole train command (one optimizer step over the batch), then, in the same process and
    state, the throughput floor: forward + backward alone on the same packed micro-batches."""
    import torch

    from tests.support.train_settings import flat_settings
    from workers import protocol
    from workers.protocol.train_settings import CriticSettings, ReturnsSettings
    from workers.train_rank import packing
    from workers.train_rank.trainer import Trainer

    torch.set_num_threads(threads)
    device = torch.device(device_name)
    shape = Shape(**shape_fields)
    wire = _wire(shape, vocab_size)
    trainer = Trainer(rank=0, world_size=1, device=device)
    settings = flat_settings(_settings(model_dir, shape, dtype, attn))
    if critic:
        settings = settings.replace(returns=ReturnsSettings(estimator="ppo", normalize=True),
                                    critic=CriticSettings(lr=1e-5))
    trainer.init(init_command(settings))
    groups = packing.plan(wire, max_tokens=shape.max_tokens_per_gpu, micro_batch_size=None)
    batches = [packing.pack([wire[i] for i in group], 0).to(device) for group in groups]
    _forward_backward(trainer.model, batches[-1:])  # warm-up: the smallest micro-batch
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    else:
        Path("/proc/self/clear_refs").write_text("5")
    started = time.perf_counter()
    answer = trainer.train(protocol.TrainCommand(0, [wire], [sum(len(s.loss_mask) for s in wire)]))
    _sync(device)
    train_s = time.perf_counter() - started
    peak = _peak_bytes(device)
    step = answer.steps[0]
    with counting_pairs() as pairs:  # one forward of every micro-batch: the attention pairs the kernel computed
        floor_s = _forward_backward(trainer.model, batches)
    _sync(device)
    return {"train_s": train_s, "floor_s": floor_s, "peak_bytes": peak, "real_tokens": step.num_tokens,
            "computed_tokens": sum(batch.computed_tokens for batch in batches), "micro_batches": len(batches),
            "loss": step.loss, "grad_norm": step.grad_norm, "pairs": pairs[0], "attention_calls": pairs[1],
            "needed_pairs": needed_pairs(batches, trainer.model.config.num_hidden_layers),
            "parameters": sum(p.numel() for p in trainer.model.parameters())}


def floor_process(model_dir: str, shape_fields: dict[str, Any], vocab_size: int, device_name: str, dtype: str,
                  attn: str | None, threads: int) -> dict[str, Any]:
    """The memory floor: the same model and AdamW, and one forward + backward + step of the largest packed
    micro-batch with chunked logprobs: what training one micro-batch needs at least."""
    import torch

    from workers.shared_torch.token_scores import token_scores
    from workers.train_rank import packing
    from workers.train_rank.model import load_causal_lm
    from workers.train_rank.optim import build_optimizer

    torch.set_num_threads(threads)
    device = torch.device(device_name)
    shape = Shape(**shape_fields)
    wire = _wire(shape, vocab_size)
    model = load_causal_lm(model_dir, dtype=getattr(torch, dtype), device=device, attn_implementation=attn)
    optimizer = build_optimizer(model, lr=1e-5, weight_decay=0.0, betas=(0.9, 0.999), eps=1e-8)
    groups = packing.plan(wire, max_tokens=shape.max_tokens_per_gpu, micro_batch_size=None)
    largest = max(groups, key=lambda group: sum(len(wire[i].tokens) for i in group))
    batch = packing.pack([wire[i] for i in largest], 0).to(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    else:
        Path("/proc/self/clear_refs").write_text("5")
    log_probs, _ = token_scores(model, input_ids=batch.input_ids, position_ids=batch.position_ids,
                                with_entropy=False, scored=batch.response_positions())
    log_probs.sum().backward()
    optimizer.step()
    _sync(device)
    return {"peak_bytes": _peak_bytes(device), "tokens": batch.num_tokens}


def shape_fields(shape: Shape) -> dict[str, Any]:
    return asdict(shape)
