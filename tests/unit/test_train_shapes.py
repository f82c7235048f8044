"""The trainer at real shapes, in this process: chunked logprobs/entropy equal the full-logits computation
(gradients included) at a fraction of its memory; packed micro-batches equal padded ones; the step's loss and
gradient do not depend on how samples are packed; packing plans stretched to a common micro-batch count."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from coordinator.train.planning import balance_by_tokens
from coordinator.train.settings import train_settings
from tests.support.memory import PeakMemory
from tests.support.train_samples import synthetic_samples
from tests.support.train_settings import init_command
from workers import protocol
from workers.protocol.train_settings import LossSettings
from workers.shared_torch import token_scores as token_scores_module
from workers.shared_torch.token_scores import (
    chunk_tokens,
    scores_from_hidden,
    token_entropy,
    token_log_probs,
    token_scores,
)
from workers.tiny_model import TinyModelSpec, build_tiny_model
from workers.train_rank.batching import collate
from workers.train_rank.loss import policy_loss
from workers.train_rank.model import load_causal_lm
from workers.train_rank.packing import first_fit_decreasing, pack, split_to_count
from workers.train_rank.trainer import Trainer

torch.set_num_threads(1)
CPU = torch.device("cpu")


def gradients(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    grads = {name: param.grad.clone() for name, param in model.named_parameters() if param.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def assert_same_gradients(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor]) -> None:
    assert set(ours) == set(theirs) and ours
    for name in ours:
        assert float((ours[name] - theirs[name]).abs().max()) <= 1e-5, name


@pytest.mark.parametrize("chunk_size", [1, 7, -1, None])
def test_chunked_scores_equal_the_full_logits_gradients_included(tiny_model_dir: Path, chunk_size: int | None) -> None:
    model = load_causal_lm(str(tiny_model_dir), dtype=torch.float32, device=CPU)
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, model.config.vocab_size, (2, 29), generator=generator)
    weights = torch.randn(2, 28, generator=generator)
    for entropy_grad in (False, True):
        logits = model(input_ids=input_ids).logits
        full_lp, full_entropy = token_log_probs(logits, input_ids), token_entropy(logits)
        ((full_lp * weights).sum() + (0.3 * (full_entropy * weights).sum() if entropy_grad else 0.0)).backward()
        full_grads = gradients(model)
        log_probs, entropy = token_scores(model, input_ids=input_ids, chunk_size=chunk_size,
                                          entropy_grad=entropy_grad)
        assert entropy is not None and entropy.requires_grad == entropy_grad
        ((log_probs * weights).sum() + (0.3 * (entropy * weights).sum() if entropy_grad else 0.0)).backward()
        assert float((log_probs - full_lp).detach().abs().max()) <= 1e-5
        assert float((entropy - full_entropy).detach().abs().max()) <= 1e-5
        assert_same_gradients(gradients(model), full_grads)


@pytest.mark.parametrize("scale", [0.05, 1.0, 30.0])
def test_the_entropy_metric_equals_the_naive_computation(scale: float) -> None:
    """The forward's entropy metric and logprobs against `-Σ p log p` and log_softmax in float64 over the same
    float32 logits, at a 32k vocabulary: a flat (H ≈ log V), a middling and a peaked distribution (H ≈ 0),
    to 1e-5 of max(H, 1) (logprobs 1e-6), with a ragged last chunk and a bias; and the logprobs bit for bit those of a forward
    without the metric (the engine's true-on-policy rescoring asks for none, the trainer for it: a one-`exp`
    form of the metric that rounded the logprobs differently broke `--true-on-policy-mode`'s exact 0.0)."""
    generator = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(16, 32_768)
    with torch.no_grad():
        head.weight.copy_(torch.randn(head.weight.shape, generator=generator) * scale)
        head.bias.copy_(torch.randn(head.bias.shape, generator=generator) * scale)
    hidden = torch.randn(37, 16, generator=generator)
    targets = torch.randint(0, 32_768, (37,), generator=generator)
    with torch.no_grad():
        log_probs, entropy = scores_from_hidden(hidden, head, targets, chunk=16, entropy=1)
        exact = torch.log_softmax(head(hidden).double(), dim=-1)
        without_metric, zeros = scores_from_hidden(hidden, head, targets, chunk=16, entropy=0)
    assert torch.equal(log_probs, without_metric) and not zeros.any()
    naive_entropy = -(exact.exp() * exact).sum(-1)
    naive_log_probs = exact.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    # the metric sums 32k float32 terms (measured 3.3e-6 at the middling scale); the logprobs are log_softmax's
    assert float(((entropy - naive_entropy).abs() / naive_entropy.clamp(min=1.0)).max()) <= 1e-5
    assert float(((log_probs - naive_log_probs).abs() / naive_log_probs.abs().clamp(min=1.0)).max()) <= 1e-6


@pytest.mark.parametrize("entropy", [0, 1, 2])
def test_scratch_reuse_changes_no_bit(monkeypatch: pytest.MonkeyPatch, entropy: int) -> None:
    """On the CPU a float32 head's chunks write into two scratch tensors reused chunk after chunk (no fresh
    mmap per chunk): logprobs, entropies and the gradients of hidden, weight and bias are bit for bit those of
    the same chunks each allocating its own tensors, over a ragged last chunk."""
    generator = torch.Generator().manual_seed(1)
    hidden = torch.randn(45, 16, generator=generator)
    weight = torch.randn(3_001, 16, generator=generator) * 0.5
    bias = torch.randn(3_001, generator=generator) * 0.1
    targets = torch.randint(0, 3_001, (45,), generator=generator)
    upstream = torch.randn(45, generator=generator)

    def run() -> list[torch.Tensor]:
        inputs = [tensor.clone().requires_grad_() for tensor in (hidden, weight, bias)]
        log_probs, entropies = token_scores_module.ChunkedTokenScores.apply(*inputs, targets, 16, entropy)
        loss = (log_probs * upstream).sum() + ((entropies * upstream.flip(0)).sum() if entropy == 2 else 0.0)
        return [log_probs.detach(), entropies.detach(), *torch.autograd.grad(loss, inputs)]

    scratch_calls: list[int] = []
    real_scratch = token_scores_module._scratch
    monkeypatch.setattr(token_scores_module, "_scratch",
                        lambda *args: scratch_calls.append(1) or real_scratch(*args))  # type: ignore[func-returns-value]
    reused = run()
    assert len(scratch_calls) == 2  # forward and backward took the scratch path
    monkeypatch.setattr(token_scores_module, "_scratch", lambda *args: None)
    fresh = run()
    assert all(torch.equal(ours, theirs) for ours, theirs in zip(reused, fresh, strict=True))


def test_chunk_size_means_what_slimes_flag_means() -> None:
    assert chunk_tokens(512, 151_936) == 512
    assert chunk_tokens(-1, 151_936) is None  # slime's default: the whole micro-batch at once
    assert chunk_tokens(None, 151_936) == 256 * 2**20 // (4 * 151_936)  # ours: ≤ 256 MiB of float32 logits


def test_chunked_memory_does_not_grow_with_the_vocabulary_times_the_length(tmp_path: Path) -> None:
    """Qwen3's vocabulary: doubling the positions from 384 to 768 adds 222 MiB of [L, V] float32 logits to a
    full computation; a chunked forward + backward grows by a small fraction of that, and at 768 positions
    peaks at well under the full logits alone."""
    directory = build_tiny_model(tmp_path / "wide", TinyModelSpec(hidden_size=16, num_hidden_layers=1,
                                                                   intermediate_size=32, num_attention_heads=2,
                                                                   num_key_value_heads=1, vocab_size=151_936,
                                                                   max_position_embeddings=1024))
    model = load_causal_lm(str(directory), dtype=torch.float32, device=CPU)

    def growth_mib(length: int) -> float:
        input_ids = torch.randint(0, 151_936, (1, length), generator=torch.Generator().manual_seed(length))
        peak = PeakMemory()
        log_probs, _ = token_scores(model, input_ids=input_ids, chunk_size=64, with_entropy=True)
        log_probs.sum().backward()
        assert torch.isfinite(log_probs.detach()).all()
        model.zero_grad(set_to_none=True)
        return peak.growth_mib

    def full_logits_mib(length: int) -> float:
        return length * 151_936 * 4 / 2**20

    long = growth_mib(768)  # first: nothing freed before it is reused, so the short one can only read lower
    short = growth_mib(384)
    assert long - short < 0.2 * (full_logits_mib(768) - full_logits_mib(384)), (long, short)
    assert long < 0.5 * full_logits_mib(768), long


def test_packed_micro_batch_equals_padded_logprobs_and_gradients(tiny_model_dir: Path) -> None:
    samples = synthetic_samples(tiny_model_dir, 6, seed=4)
    model = load_causal_lm(str(tiny_model_dir), dtype=torch.float32, device=CPU)
    padded, packed = collate(samples, pad_token_id=0), pack(samples, pad_token_id=0)
    assert packed.input_ids.shape == (1, sum(len(s.tokens) for s in samples)) and packed.attention_mask is None
    weights = [torch.randn(end - start, generator=torch.Generator().manual_seed(i))
               for i, (start, end) in enumerate(padded.spans)]

    def response_sum(log_probs: torch.Tensor, spans: tuple[tuple[int, int], ...]) -> tuple[torch.Tensor, list]:
        flat = log_probs.reshape(-1)
        pieces = [flat[start:end] for start, end in spans]
        return sum((piece * weight).sum() for piece, weight in zip(pieces, weights, strict=True)), pieces

    logits = model(input_ids=padded.input_ids, attention_mask=padded.attention_mask).logits
    padded_loss, padded_pieces = response_sum(token_log_probs(logits, padded.input_ids), padded.spans)
    padded_loss.backward()
    padded_grads = gradients(model)
    # only the responses are scored (the trainer's way): the same values there, 0 elsewhere
    scored = packed.response_positions()
    assert int(scored.sum()) == sum(len(sample.loss_mask) for sample in samples)
    log_probs, _ = token_scores(model, input_ids=packed.input_ids, position_ids=packed.position_ids, chunk_size=5,
                                scored=scored)
    assert float(log_probs.detach()[~scored].abs().max()) == 0.0
    packed_loss, packed_pieces = response_sum(log_probs, packed.spans)
    packed_loss.backward()
    for ours, theirs, sample in zip(packed_pieces, padded_pieces, samples, strict=True):
        assert float((ours - theirs).detach().abs().max()) <= 1e-5
        # attention stayed within the sample: the engine's logprobs of it alone
        assert float((ours.detach() - torch.tensor(sample.rollout_log_probs)).abs().max()) <= 1e-5
    assert_same_gradients(gradients(model), padded_grads)
    # the loss mask covers exactly each sample's response; the tokens count is the real tokens
    assert int(packed.loss_mask.sum()) == sum(sum(s.loss_mask) for s in samples) == int(padded.loss_mask.sum())
    assert packed.num_tokens == packed.computed_tokens < padded.computed_tokens


def test_gspo_sequence_ratio_is_per_sample_in_a_packed_row(tiny_model_dir: Path) -> None:
    samples = synthetic_samples(tiny_model_dir, 5, seed=6)
    for index, sample in enumerate(samples):
        sample.advantage = 1.0 if index % 2 else -0.5
    config = LossSettings(eps_clip=0.2, eps_clip_high=0.2, policy_loss="gspo")
    results = []
    for batch in (collate(samples, 0), pack(samples, 0)):
        shifted = batch.rollout_log_probs + 0.07 * (batch.sample_ids + 1) * batch.loss_mask  # a ratio per sample
        loss, sums, _ = policy_loss(log_probs=shifted, rollout_log_probs=batch.rollout_log_probs,
                                    advantages=batch.advantages, loss_mask=batch.loss_mask, global_loss_tokens=20,
                                    config=config, entropy=torch.zeros_like(shifted), sample_ids=batch.sample_ids)
        results.append((float(loss), sums["clipped_tokens"]))
    assert results[0] == pytest.approx(results[1], abs=1e-6)


def train_once(model_dir: Path, samples: list[protocol.WireSample], **config: object) -> protocol.StepMetrics:
    trainer = Trainer(rank=0, world_size=1, device=CPU)
    trainer.init(init_command({"model_path": str(model_dir), "lr": 1e-3, "seed": 3, "use_kl_loss": True,
                                       "kl_loss_coef": 0.1, "entropy_coef": 0.01, **config}))
    answer = trainer.train(protocol.TrainCommand(0, [samples], [sum(len(s.loss_mask) for s in samples)]))
    return answer.steps[0]


@pytest.mark.parametrize("policy", ["ppo", "gspo"])
def test_the_step_does_not_depend_on_how_samples_are_packed(tiny_model_dir: Path, policy: str) -> None:
    samples = synthetic_samples(tiny_model_dir, 8, seed=8)
    for index, sample in enumerate(samples):
        sample.advantage = (-1.0) ** index
        sample.rollout_log_probs = [value - 0.1 for value in sample.rollout_log_probs]
    one = train_once(tiny_model_dir, samples, max_tokens_per_micro_batch=10**6, policy_loss=policy)
    many = train_once(tiny_model_dir, samples, max_tokens_per_micro_batch=20, policy_loss=policy,
                      log_probs_chunk_size=3)
    each = train_once(tiny_model_dir, samples, micro_batch_size=1, policy_loss=policy, log_probs_chunk_size=-1)
    for other in (many, each):
        for key in ("loss", "pg_loss", "kl_sum", "entropy_sum", "clipped_tokens", "loss_tokens", "num_tokens"):
            assert getattr(other, key) == pytest.approx(getattr(one, key), rel=1e-6, abs=1e-6), key
        assert other.grad_norm == pytest.approx(one.grad_norm, rel=1e-5)
    assert one.num_tokens == sum(len(sample.tokens) for sample in samples)


def long_tailed_lengths(count: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [min(8192, 64 + int(rng.lognormvariate(7.2, 0.9))) for _ in range(count)]


def test_first_fit_decreasing_packs_whole_samples_within_the_budget() -> None:
    lengths = long_tailed_lengths(256, seed=1)
    bins = first_fit_decreasing(lengths, 8192)
    assert sorted(i for group in bins for i in group) == list(range(256))
    assert all(sum(lengths[i] for i in group) <= 8192 for group in bins)
    # close to the lower bound: at most one bin more than the tokens need, on this distribution
    assert len(bins) <= -(-sum(lengths) // 8192) + 1


def test_balanced_packing_across_two_ranks_gives_equal_tokens_and_micro_batch_counts() -> None:
    lengths = long_tailed_lengths(64, seed=2)
    shards = balance_by_tokens(lengths, 2)
    loads = [sum(lengths[i] for i in shard) for shard in shards]
    assert abs(loads[0] - loads[1]) <= min(lengths)  # as equal as whole samples allow
    plans = [first_fit_decreasing([lengths[i] for i in shard], 4096) for shard in shards]
    count = max(len(plan) for plan in plans)
    for shard, plan in zip(shards, plans, strict=True):
        stretched = split_to_count(plan, [lengths[i] for i in shard], count)
        assert len(stretched) == count
        assert sorted(i for group in stretched for i in group) == list(range(len(shard)))
        assert all(sum(lengths[shard[i]] for i in group) <= 4096 or len(group) == 1 for group in stretched)
    # fewer samples than micro-batches: empty ones make up the count (a forward of no loss tokens)
    assert split_to_count([[0, 1]], [5, 5], 4) == [[0], [1], [], []]
    empty = pack([], pad_token_id=0)
    assert empty.num_tokens == 0 and float(empty.loss_mask.sum()) == 0.0


def test_the_flags_reach_the_rank_settings(tiny_model_dir: Path) -> None:
    from coordinator.config.parser import parse_config

    base = ["--hf-checkpoint", str(tiny_model_dir), "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
            "--num-rollout", "1", "--prompt-data", "builtin:first_digit", "--rollout-num-engines", "1"]
    default = train_settings(parse_config(base))
    assert (default.batching.log_probs_chunk_size, default.parallel.train_pg_timeout_s,
            default.model.attn_implementation) == (None, 300.0, None)
    config = parse_config([*base, "--log-probs-chunk-size", "-1", "--train-pg-timeout-s", "30",
                           "--attn-implementation", "eager"])
    settings = train_settings(config)
    assert (settings.batching.log_probs_chunk_size, settings.parallel.train_pg_timeout_s,
            settings.model.attn_implementation) == (-1, 30.0, "eager")
