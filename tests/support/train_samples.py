"""Training inputs shared by the rank, train group and GPU tests: synthetic samples with the logprobs an
engine would report, their `Sample` form, and the train group's base settings."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import torch

from replay.sample import Sample, SampleStatus
from workers import protocol

TRAIN_CONFIG: dict[str, Any] = {
    "lr": 1e-3,
    "warmup_steps": 2,
    "eps_clip": 0.2,
    "eps_clip_high": 0.28,
    "kl_loss_coef": 0.01,
    "use_kl_loss": True,
    "clip_grad": 1.0,
    "max_tokens_per_micro_batch": 48,
    "seed": 7,
    "global_batch_size": 4,
}


def reference_log_probs(model: torch.nn.Module, tokens: list[int], response_length: int) -> list[float]:
    """What an engine reports: log_softmax at temperature 1 of each response token, one sequence alone."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([tokens])).logits[0].float()
    log_probs = torch.log_softmax(logits, dim=-1)
    start = len(tokens) - response_length
    return [float(log_probs[position - 1, tokens[position]]) for position in range(start, len(tokens))]


def synthetic_samples(model_dir: Path, count: int, seed: int) -> list[protocol.WireSample]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    rng = random.Random(seed)
    samples = []
    for _ in range(count):
        prompt = " ".join(str(rng.randrange(10)) for _ in range(rng.randrange(2, 5))) + "="
        response = "".join(rng.choice("0123456789abc") for _ in range(rng.randrange(1, 6)))
        prompt_ids = tokenizer(prompt)["input_ids"]
        response_ids = tokenizer(response)["input_ids"]
        tokens = prompt_ids + response_ids
        samples.append(
            protocol.WireSample(
                tokens=tokens,
                response_length=len(response_ids),
                loss_mask=[1] * len(response_ids),
                rollout_log_probs=reference_log_probs(model, tokens, len(response_ids)),
                advantage=rng.gauss(0.0, 1.0),
            )
        )
    return samples


def as_samples(raw: list[protocol.WireSample]) -> list[Sample]:
    return [
        Sample(
            group_index=index // 2,
            sample_index=index % 2,
            prompt="",
            tokens=list(item.tokens),
            response_length=item.response_length,
            loss_mask=list(item.loss_mask),
            rollout_log_probs=list(item.rollout_log_probs),
            reward=0.0,
            status=SampleStatus.COMPLETED,
            advantage=item.advantage,
        )
        for index, item in enumerate(raw)
    ]
