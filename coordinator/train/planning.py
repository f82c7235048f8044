"""Pure planning of a training call: samples cut into optimizer steps and per-rank shards, and the ranks'
step metrics reduced into what the run reports.

Owns the batch settings' rules (`global_batch_size` / `num_steps_per_rollout` / miles' dynamic global batch size)
and the metric formulas.
Invariants: steps keep the samples' order and every rank gets at least one sample of every step (so every
rank runs the same number of optimizer steps, and enters every collective); the split is deterministic.
No I/O and no anyio here: everything is a function of its arguments.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from workers.protocol import StepMetrics, WireSample
from workers.protocol.train_settings import BatchingSettings


@dataclass
class StepPlan:
    """One optimizer step: `shards[rank]` is that rank's samples; `loss_tokens` counts the whole step's."""

    shards: list[list[WireSample]]
    loss_tokens: int


def plan_steps(samples: list[WireSample], batching: BatchingSettings, world_size: int) -> list[StepPlan]:
    """Cut samples into optimizer steps (in order) and each step into per-rank shards by token count."""
    if not samples:
        raise ValueError("train() got no samples")
    global_batch_size, num_steps = batching.global_batch_size, batching.num_steps_per_rollout
    if batching.dynamic_global_batch_size:
        # miles' _compute_dynamic_global_batch_size: one step over the samples rounded down to a multiple of the
        # data-parallel ranks (at least one per rank); the rest are dropped, as miles trims them
        global_batch_size = max(len(samples) // world_size * world_size, world_size)
        samples = samples[:global_batch_size]
        num_steps = None
    if num_steps is not None:
        if len(samples) % num_steps:
            raise ValueError(
                f"{len(samples)} samples cannot be cut into num_steps_per_rollout={num_steps} equal steps"
            )
        global_batch_size = len(samples) // num_steps
    if global_batch_size is None:
        global_batch_size = len(samples)
    if len(samples) % global_batch_size:
        raise ValueError(
            f"{len(samples)} samples are not a multiple of global_batch_size={global_batch_size}; "
            "make rollout_batch_size × n_samples_per_prompt divisible by it"
        )
    # A step of fewer samples than ranks leaves some shards empty: those ranks run one empty micro-batch
    # (`Trainer._micro_batches`), and the step's token mean is the same however it is split.
    plan = []
    for start in range(0, len(samples), global_batch_size):
        step = samples[start : start + global_batch_size]
        shards = balance_by_tokens([len(sample.tokens) for sample in step], world_size)
        plan.append(
            StepPlan(
                shards=[[step[index] for index in shard] for shard in shards],
                loss_tokens=sum(int(sample.loss_mask.sum()) for sample in step),
            )
        )
    return plan


def balance_by_tokens(lengths: Sequence[int], parts: int) -> list[list[int]]:
    """Greedy longest-first partition of indices into `parts` lists with near-equal token sums.

    Every part gets at least one index when there are enough; each part keeps its indices in their
    original order so the split is deterministic.
    """
    loads = [0] * parts
    shards: list[list[int]] = [[] for _ in range(parts)]
    order = sorted(range(len(lengths)), key=lambda index: (-lengths[index], index))
    for position, index in enumerate(order):
        if position < parts:
            target = position
        else:
            target = min(range(parts), key=lambda part: (loads[part], len(shards[part]), part))
        shards[target].append(index)
        loads[target] += lengths[index]
    return [sorted(shard) for shard in shards]


def reduce_step_metrics(rank_steps: Sequence[StepMetrics]) -> dict[str, float]:
    """Combine the ranks' raw numbers for one optimizer step (rank order) into the step's metrics."""

    def total(name: str) -> float:
        return sum(float(getattr(step, name)) for step in rank_steps)

    loss_tokens = total("loss_tokens")
    per_token = max(loss_tokens, 1.0)
    num_tokens = total("num_tokens")
    step_time = max(float(step.step_time_s) for step in rank_steps)
    return {
        "loss": total("loss"),
        "pg_loss": total("pg_loss"),
        "pg_clipfrac": total("clipped_tokens") / per_token,
        "kl": total("kl_sum") / per_token,
        "entropy": total("entropy_sum") / per_token,
        "grad_norm": float(rank_steps[0].grad_norm),
        # 0 when the ranks agree: their gradients were all-reduced (across nodes too) before clipping
        "grad_norm_rank_spread": max(float(step.grad_norm) for step in rank_steps)
        - min(float(step.grad_norm) for step in rank_steps),
        "lr": float(rank_steps[0].lr),
        "num_tokens": num_tokens,
        "loss_tokens": loss_tokens,
        "step_time_s": step_time,
        "tokens_per_s": num_tokens / step_time if step_time > 0 else 0.0,
        "train_rollout_logprob_abs_diff_mean": total("logprob_abs_diff_sum") / per_token,
        "train_rollout_logprob_abs_diff_max": max(
            [0.0, *(float(step.logprob_abs_diff_max) for step in rank_steps)]
        ),
        # A TIS hook's metrics: token means over the step's loss tokens, under the hook's own names.
        **{key: sum(float(step.extra.get(key, 0.0)) for step in rank_steps) / per_token
           for key in sorted({key for step in rank_steps for key in step.extra})},
    }


def reduce_rollout_metrics(steps: Sequence[dict[str, float]]) -> dict[str, float]:
    """One rollout's metrics: step means, totals for counts, and the mismatch of the first step only
    (the only one measured before any update, so it isolates train/inference numerics)."""
    count = len(steps)
    result = {
        key: sum(step[key] for step in steps) / count
        for key in ("loss", "pg_loss", "pg_clipfrac", "kl", "entropy", "grad_norm")
    }
    total_tokens = sum(step["num_tokens"] for step in steps)
    total_time = sum(step["step_time_s"] for step in steps)
    result.update(
        {
            "lr": steps[-1]["lr"],
            "num_tokens": total_tokens,
            "loss_tokens": sum(step["loss_tokens"] for step in steps),
            "tokens_per_s": total_tokens / total_time if total_time > 0 else 0.0,
            "train_time_s": total_time,
            "num_steps": float(count),
            "grad_norm_rank_spread": max(step.get("grad_norm_rank_spread", 0.0) for step in steps),
            "train_rollout_logprob_abs_diff_mean": steps[0]["train_rollout_logprob_abs_diff_mean"],
            "train_rollout_logprob_abs_diff_max": steps[0]["train_rollout_logprob_abs_diff_max"],
        }
    )
    known = {"loss", "pg_loss", "pg_clipfrac", "kl", "entropy", "grad_norm", "lr", "num_tokens", "loss_tokens",
             "step_time_s", "tokens_per_s", "train_rollout_logprob_abs_diff_mean", "train_rollout_logprob_abs_diff_max"}
    for key in sorted({key for step in steps for key in step} - known):  # a TIS hook's metrics: step means
        result[key] = sum(step.get(key, 0.0) for step in steps) / count
    return result
