"""The training rank's parts, in this process (no torchrun): batching and logprobs, the loss, the
schedule, settings validation, the HF snapshot, and one-process training determinism."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import msgspec
import pytest
import torch
from msgspec.structs import replace

from tests.support.train_samples import synthetic_samples
from tests.support.train_settings import init_command
from workers import protocol
from workers.protocol.train_settings import (
    BatchingSettings,
    LossSettings,
    ModelSettings,
    SettingsError,
    TrainSettings,
)
from workers.shared_torch.token_scores import token_log_probs
from workers.train_rank import tensor_files, weight_export
from workers.train_rank.batching import BatchError, collate
from workers.train_rank.loss import approx_kl, policy_loss
from workers.train_rank.model import load_causal_lm
from workers.train_rank.optim import LrSchedule, build_optimizer, build_scheduler
from workers.train_rank.packing import first_fit_decreasing, pack, plan
from workers.train_rank.trainer import Trainer

torch.set_num_threads(1)


def test_micro_batches_respect_the_token_budget() -> None:
    assert first_fit_decreasing([3, 3, 3, 3], 6) == [[0, 1], [2, 3]]
    # Real tokens count, longest first into the first bin with room; one over the budget goes alone.
    assert first_fit_decreasing([2, 2, 5, 9, 1], 6) == [[3], [2, 4], [0, 1]]
    assert first_fit_decreasing([4, 4, 4], 100) == [[0, 1, 2]]


def test_padded_micro_batch_logprobs_match_single_sequence_forward(tiny_model_dir: Path) -> None:
    samples = synthetic_samples(tiny_model_dir, 6, seed=1)
    model = load_causal_lm(
        str(tiny_model_dir), dtype=torch.float32, device=torch.device("cpu"), trainable=False
    )
    batches = [collate([samples[i] for i in group], pad_token_id=0)
               for group in plan(samples, max_tokens=40, micro_batch_size=None)]
    assert len(batches) > 1
    worst = 0.0
    with torch.no_grad():
        for batch in batches:
            log_probs = token_log_probs(
                model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits, batch.input_ids
            )
            mask = batch.loss_mask.bool()
            worst = max(worst, float((log_probs[mask] - batch.rollout_log_probs[mask]).abs().max()))
    assert worst < 1e-5
    assert sum(int(batch.loss_mask.sum()) for batch in batches) == sum(len(s.loss_mask) for s in samples)


def test_malformed_samples_are_rejected_with_the_field_named() -> None:
    good = protocol.WireSample(tokens=[5, 6, 7], response_length=1, loss_mask=[1], rollout_log_probs=[-1.0])
    with pytest.raises(ValueError, match="loss_mask has 2 entries, response_length is 1"):
        replace(good, loss_mask=[1, 1])  # refused when built (and when decoded: test_wire_arrays)
    bad = replace(good)
    bad.loss_mask = [1, 1]  # set after building: the rank's batching still names it
    with pytest.raises(BatchError, match="sample 1: loss_mask has 2 entries, response_length is 1"):
        plan([good, bad], max_tokens=10, micro_batch_size=None)
    with pytest.raises(BatchError, match="must leave at least one prompt token"):
        plan([replace(good, response_length=3, loss_mask=[1] * 3, rollout_log_probs=[0.0] * 3)],
             max_tokens=10, micro_batch_size=None)


def test_policy_loss_is_a_global_token_mean_with_ppo_clipping() -> None:
    config = LossSettings(eps_clip=0.2, eps_clip_high=0.3)
    rollout = torch.tensor([[-1.0, -1.0, -1.0, -1.0]])
    advantages = torch.tensor([[1.0, 1.0, -1.0, 2.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    entropy = torch.zeros(1, 4)
    # On-policy: ratio 1, loss = -sum(adv·mask) / global tokens (10 here, as if other ranks had 7 more).
    log_probs = rollout.clone().requires_grad_(True)
    loss, sums, _ = policy_loss(
        log_probs=log_probs,
        rollout_log_probs=rollout,
        advantages=advantages,
        loss_mask=mask,
        global_loss_tokens=10,
        config=config,
        entropy=entropy,
    )
    assert math.isclose(float(loss.detach()), -(1 + 1 - 1) / 10, abs_tol=1e-7)
    assert sums["clipped_tokens"] == 0 and sums["loss_tokens"] == 3
    # Ratio e^1 ≈ 2.72 > 1 + 0.3 on a positive advantage: clipped, so that token gets no gradient.
    log_probs = torch.tensor([[0.0, -1.0, -1.0, -1.0]], requires_grad=True)
    loss, sums, maxima = policy_loss(
        log_probs=log_probs,
        rollout_log_probs=rollout,
        advantages=advantages,
        loss_mask=mask,
        global_loss_tokens=3,
        config=config,
        entropy=entropy,
    )
    loss.backward()
    assert sums["clipped_tokens"] == 1
    assert log_probs.grad is not None and log_probs.grad[0, 0] == 0 and log_probs.grad[0, 1] != 0
    assert math.isclose(maxima["logprob_abs_diff_max"], 1.0)
    assert math.isclose(float(loss.detach()), (-1.3 - 1 + 1) / 3, rel_tol=1e-6)


def test_k3_kl_is_zero_against_itself_and_positive_otherwise() -> None:
    config = LossSettings(eps_clip=0.2, eps_clip_high=0.2, use_kl_loss=True, kl_loss_coef=0.5, kl_loss_type="k3")
    base = dict(
        rollout_log_probs=torch.full((1, 3), -1.0),
        advantages=torch.zeros(1, 3),
        loss_mask=torch.ones(1, 3),
        global_loss_tokens=3,
        config=config,
        entropy=torch.zeros(1, 3),
    )
    log_probs = torch.full((1, 3), -1.0)
    loss, sums, _ = policy_loss(log_probs=log_probs, ref_log_probs=log_probs.clone(), **base)
    assert sums["kl_sum"] == 0 and float(loss.detach()) == 0
    loss, sums, _ = policy_loss(log_probs=log_probs, ref_log_probs=torch.full((1, 3), -2.0), **base)
    expected = math.exp(-1) + 1 - 1  # k3 with r = -1
    assert math.isclose(sums["kl_sum"], 3 * expected, rel_tol=1e-6)
    assert math.isclose(float(loss.detach()), 0.5 * expected, rel_tol=1e-6)


def test_lr_schedule_is_megatrons_and_its_state_is_plain_data() -> None:
    # Warm-up from init: step s (steps already taken) gets init + (lr - init)·s/warmup, so step 0 runs at init.
    warm = LrSchedule(lr=1.0, warmup_steps=4)
    assert [warm.lr_at(step) for step in range(6)] == [0.0, 0.25, 0.5, 0.75, 1.0, 1.0]
    assert LrSchedule(lr=1.0)(0) == 1.0
    # Linear and cosine decay to min_lr over the decay span after warm-up, then min_lr.
    linear = LrSchedule(lr=1.0, min_lr=0.1, style="linear", decay_steps=10, warmup_steps=0)
    assert [round(linear.lr_at(step), 6) for step in (0, 5, 10, 11)] == [1.0, 0.55, 0.1, 0.1]
    cosine = LrSchedule(lr=1.0, min_lr=0.0, style="cosine", decay_steps=12, warmup_steps=2, warmup_init_lr=0.5)
    assert cosine.lr_at(1) == pytest.approx(0.75)
    assert cosine.lr_at(2) == pytest.approx(1.0)
    assert cosine.lr_at(7) == pytest.approx(0.5)  # half way through the decay: (1 + cos(π/2)) / 2
    assert cosine.lr_at(12) == pytest.approx(0.0, abs=1e-12)
    assert LrSchedule(lr=1.0, min_lr=0.2, style="constant", decay_steps=3).lr_at(100) == 1.0
    model = torch.nn.Linear(2, 2)
    optimizer = build_optimizer(model, lr=0.1, weight_decay=0.0, betas=(0.9, 0.999), eps=1e-8)
    scheduler = build_scheduler(optimizer, LrSchedule(lr=0.1, warmup_steps=2, warmup_init_lr=0.02))
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.02)
    optimizer.step()
    scheduler.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.06)
    state = json.loads(json.dumps(scheduler.state_dict()))
    fresh = build_scheduler(
        build_optimizer(model, lr=0.1, weight_decay=0.0, betas=(0.9, 0.999), eps=1e-8),
        LrSchedule(lr=0.1, warmup_steps=2, warmup_init_lr=0.02),
    )
    fresh.load_state_dict(state)
    assert fresh.last_epoch == 1


def test_kl_estimators_are_slimes() -> None:
    policy = torch.tensor([-1.0, -2.0, -0.5])
    reference = torch.tensor([-1.5, -1.0, -0.5])
    x = policy - reference  # log(policy / reference)
    assert torch.allclose(approx_kl(policy, reference, "k1"), x)
    assert torch.allclose(approx_kl(policy, reference, "k2"), x.square() / 2)
    k3 = torch.exp(-x) - 1 + x
    assert torch.allclose(approx_kl(policy, reference, "k3"), k3)
    assert bool((k3 >= 0).all()) and float(k3[2]) == 0.0
    # low_var_kl is k3 clamped to [-10, 10]; k3 itself is not clamped.
    far = approx_kl(torch.tensor([-20.0]), torch.tensor([-1.0]), "k3")
    assert float(far) > 10 and float(approx_kl(torch.tensor([-20.0]), torch.tensor([-1.0]), "low_var_kl")) == 10.0


def _loss(config: LossSettings, **overrides: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
    base: dict = dict(
        log_probs=torch.tensor([[-1.0, -1.2, -0.8]], requires_grad=True),
        rollout_log_probs=torch.full((1, 3), -1.0),
        advantages=torch.tensor([[1.0, 1.0, 1.0]]),
        loss_mask=torch.ones(1, 3),
        global_loss_tokens=3,
        config=config,
        entropy=torch.zeros(1, 3),
    )
    base.update(overrides)
    loss, sums, _ = policy_loss(**base)
    return loss.detach(), sums


def test_kl_loss_coef_adds_the_kl_term_only_with_use_kl_loss() -> None:
    reference = torch.full((1, 3), -1.5)
    plain, _ = _loss(LossSettings(eps_clip=0.2, eps_clip_high=0.2))
    for kl_type in ("k1", "k2", "k3", "low_var_kl"):
        config = LossSettings(eps_clip=0.2, eps_clip_high=0.2, use_kl_loss=True, kl_loss_coef=0.1,
                            kl_loss_type=kl_type)
        with_kl, sums = _loss(config, ref_log_probs=reference)
        kl = approx_kl(torch.tensor([[-1.0, -1.2, -0.8]]), reference, kl_type)
        assert math.isclose(float(with_kl - plain), 0.1 * float(kl.mean()), rel_tol=1e-5, abs_tol=1e-7)
        assert math.isclose(sums["kl_sum"], float(kl.sum()), rel_tol=1e-5)
    # slime's `--use-kl-loss --kl-loss-coef 0`: the KL is measured, the loss is unchanged.
    zero, sums = _loss(LossSettings(eps_clip=0.2, eps_clip_high=0.2, use_kl_loss=True, kl_loss_coef=0.0),
                       ref_log_probs=reference)
    assert float(zero) == float(plain) and sums["kl_sum"] != 0
    # Without --use-kl-loss a coefficient does nothing.
    off, _ = _loss(LossSettings(eps_clip=0.2, eps_clip_high=0.2, kl_loss_coef=0.1), ref_log_probs=reference)
    assert float(off) == float(plain)


def test_ratio_is_against_old_logprobs_and_tis_weights_by_old_over_rollout() -> None:
    config = LossSettings(eps_clip=0.2, eps_clip_high=0.2)
    log_probs = torch.tensor([[-1.0, -1.0, -1.0]])
    # On-policy against the recomputed old logprobs: ratio 1, nothing clipped, although the engine disagrees.
    _, sums = _loss(config, log_probs=log_probs, old_log_probs=log_probs.clone(),
                    rollout_log_probs=torch.full((1, 3), -3.0))
    assert sums["clipped_tokens"] == 0
    # Against the engine's logprobs (--use-rollout-logprobs): ratio e² > 1.2, clipped.
    _, sums = _loss(config, log_probs=log_probs, rollout_log_probs=torch.full((1, 3), -3.0))
    assert sums["clipped_tokens"] == 3
    # TIS: weight clamp(exp(old - rollout), 0, 2): exp(0.5) ≈ 1.65 kept, exp(2) clamped to 2, exp(-1) kept.
    tis = LossSettings(eps_clip=0.2, eps_clip_high=0.2, use_tis=True, tis_clip=2.0, tis_clip_low=0.0)
    rollout = torch.tensor([[-1.5, -3.0, 0.0]])
    loss, sums = _loss(tis, log_probs=log_probs, old_log_probs=log_probs.clone(), rollout_log_probs=rollout)
    weights = [math.exp(0.5), 2.0, math.exp(-1.0)]
    assert math.isclose(float(loss), -sum(weights) / 3, rel_tol=1e-5)
    assert math.isclose(sums["tis_sum"], sum(weights), rel_tol=1e-5) and sums["tis_clipped_tokens"] == 1


def test_gspo_clips_the_sequence_ratio() -> None:
    # Token log-ratios +0.3, -0.3, 0: per token one is clipped; the sequence's mean ratio is 1, nothing is.
    log_probs = torch.tensor([[-0.7, -1.3, -1.0]], requires_grad=True)
    _, per_token = _loss(LossSettings(eps_clip=0.2, eps_clip_high=0.2), log_probs=log_probs)
    assert per_token["clipped_tokens"] == 1
    loss, per_sequence = _loss(LossSettings(eps_clip=0.2, eps_clip_high=0.2, policy_loss="gspo"),
                               log_probs=log_probs)
    assert per_sequence["clipped_tokens"] == 0
    assert math.isclose(float(loss), -1.0, rel_tol=1e-6)  # -A · exp(mean log-ratio) = -1


def test_micro_batch_size_cuts_by_count() -> None:
    samples = [protocol.WireSample(tokens=[1] * (3 + i), response_length=1, loss_mask=[1], rollout_log_probs=[0.0])
               for i in range(5)]
    assert plan(samples, max_tokens=10**6, micro_batch_size=2) == [[0, 1], [2, 3], [4]]
    assert plan(samples, max_tokens=10**6, micro_batch_size=None) == [[0, 1, 2, 3, 4]]
    # each group is one packed row of its samples' real tokens
    assert pack(samples[:2], pad_token_id=0).input_ids.shape == (1, 3 + 4)


def test_settings_reject_unknown_keys_and_bad_values_on_both_ends_of_the_wire() -> None:
    settings = TrainSettings(model=ModelSettings(path="x"), loss=LossSettings(eps_clip=0.1))
    assert settings.loss.clip_high == 0.1
    wire = msgspec.to_builtins(settings)
    assert msgspec.convert(wire, TrainSettings) == settings
    # what the rank decodes is held to the same rules the coordinator's build is
    with pytest.raises(msgspec.ValidationError, match=r"unknown field `lrr`"):
        msgspec.convert({**wire, "optimizer": {"lrr": 1.0}}, TrainSettings)
    with pytest.raises(msgspec.ValidationError, match=r"missing required field `model`"):
        msgspec.convert({"seed": 1}, TrainSettings)
    with pytest.raises(msgspec.ValidationError, match="max_tokens_per_micro_batch must be >= 1"):
        msgspec.convert({**wire, "batching": {"max_tokens_per_micro_batch": 0}}, TrainSettings)
    with pytest.raises(SettingsError, match="slime allows only one of them"):
        LossSettings(use_tis=True, use_rollout_logprobs=True)
    with pytest.raises(SettingsError, match="not both"):
        BatchingSettings(global_batch_size=4, num_steps_per_rollout=2)
    with pytest.raises(SettingsError, match="kl_loss_type must be one of"):
        settings.replace(loss=LossSettings(kl_loss_type="k9"))


def test_snapshot_is_loadable_complete_and_pruned(tiny_model_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = load_causal_lm(str(tiny_model_dir), dtype=torch.float32, device=torch.device("cpu"))
    with torch.no_grad():
        model.model.norm.weight.add_(1.0)  # make the snapshot differ from the source
    state = weight_export.full_state_dict(model, sharded=False)
    assert "lm_head.weight" not in state  # tied to the embeddings: sent once
    paths = [
        weight_export.write_snapshot(
            state, source_dir=tiny_model_dir, directory=tmp_path, weight_version=str(v), keep=2
        )
        for v in range(3)
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["weights-1", "weights-2"]
    loaded = AutoModelForCausalLM.from_pretrained(str(paths[-1]), dtype=torch.float32)
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    assert AutoTokenizer.from_pretrained(str(paths[-1])).eos_token == "<|endoftext|>"
    assert (paths[-1] / "rayless_weight_version.txt").read_text().strip() == "2"
    # an engine checks the snapshot's manifest before it loads: a flipped byte is refused, naming the file
    from workers.engine.runner import ModelRunner, WeightUpdateError

    runner = ModelRunner(str(tiny_model_dir))
    assert runner.load_from_disk(str(paths[-1])) == len(state)
    weights_file = paths[-1] / "model.safetensors"
    data = bytearray(weights_file.read_bytes())
    data[-5] ^= 0x01
    weights_file.write_bytes(bytes(data))
    with pytest.raises(WeightUpdateError, match=f"{weights_file}: its content does not match the manifest"):
        runner.load_from_disk(str(paths[-1]))
    assert weight_export.manifest(state)[0] == [
        "model.embed_tokens.weight",
        "float32",
        list(state["model.embed_tokens.weight"].shape),
    ]


def run_single_process(
    model_dir: Path, samples: list[protocol.WireSample], steps: int
) -> list[protocol.StepMetrics]:
    trainer = Trainer(rank=0, world_size=1, device=torch.device("cpu"))
    trainer.init(
        init_command(
            # Ratios against the fixed rollout logprobs, so the loss of the same data falls step after step
            # (against recomputed old logprobs every train() call starts at ratio 1, the same loss).
            {"model_path": str(model_dir), "lr": 1e-3, "max_tokens_per_micro_batch": 32, "seed": 3,
             "use_rollout_logprobs": True}
        )
    )
    results = []
    for _ in range(steps):
        answer = trainer.train(protocol.TrainCommand(0, [samples], [sum(len(s.loss_mask) for s in samples)]))
        results.append(answer.steps[0])
    return results


def test_training_in_one_process_is_deterministic_and_moves_the_loss(tiny_model_dir: Path) -> None:
    samples = synthetic_samples(tiny_model_dir, 8, seed=2)
    first = run_single_process(tiny_model_dir, samples, steps=3)
    second = run_single_process(tiny_model_dir, samples, steps=3)
    assert [step.loss for step in first] == [step.loss for step in second]
    assert [step.grad_norm for step in first] == [step.grad_norm for step in second]
    # The first step runs on the rollout weights: recomputed logprobs equal the rollout's.
    assert first[0].logprob_abs_diff_max < 1e-5
    # Descending the loss: later steps see a lower loss on the same data.
    assert first[-1].loss < first[0].loss
    assert all(math.isfinite(step.entropy_sum) for step in first)


def test_snapshot_writer_round_trips_every_dtype_and_layout(tmp_path: Path) -> None:
    from safetensors import safe_open
    from safetensors.torch import load_file

    state = {
        "a.weight": torch.randn(3, 5),
        "b.bf16": torch.randn(7).to(torch.bfloat16),
        "c.ids": torch.arange(4, dtype=torch.int64),
        "d.empty": torch.empty(0, 3),
        "e.strided": torch.randn(4, 6).t(),
    }
    path = tmp_path / "model.safetensors"
    tensor_files.write_safetensors(state, path, metadata={"format": "pt"})
    loaded = load_file(str(path))
    assert set(loaded) == set(state)
    for name, tensor in state.items():
        assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name], tensor), name
    with safe_open(str(path), framework="pt") as handle:
        assert handle.metadata() == {"format": "pt"}


# --- multi-turn samples: a tool's tokens are response tokens with loss mask 0 ---------------------------------
def multi_turn_samples(model_dir: Path, count: int, seed: int, tool_log_prob: float) -> list[protocol.WireSample]:
    """prompt, a model turn, a tool's output, a model turn: the model's tokens carry the logprobs an engine
    reports, the tool's `tool_log_prob` (slime writes 0.0) and loss mask 0."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.support.train_samples import reference_log_probs

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    rng = random.Random(seed)
    samples = []
    for _ in range(count):
        parts = [f"{rng.randrange(10)}+{rng.randrange(10)}", "=", str(rng.randrange(100)), "ab"[: rng.randrange(1, 3)]]
        ids = [tokenizer(part, add_special_tokens=False)["input_ids"] for part in parts]
        tokens = [token for part in ids for token in part]
        mask = [1] * len(ids[1]) + [0] * len(ids[2]) + [1] * len(ids[3])
        engine = reference_log_probs(model, tokens, len(mask))
        samples.append(protocol.WireSample(
            tokens=tokens, response_length=len(mask), loss_mask=mask,
            rollout_log_probs=[lp if m else tool_log_prob for lp, m in zip(engine, mask, strict=True)],
            advantage=rng.gauss(0.0, 1.0)))
    return samples


def train_steps(model_dir: Path, samples: list[protocol.WireSample], steps: int,
                **settings: object) -> list[protocol.StepMetrics]:
    trainer = Trainer(rank=0, world_size=1, device=torch.device("cpu"))
    trainer.init(init_command({"model_path": str(model_dir), "lr": 1e-3, "max_tokens_per_micro_batch": 32,
                                       "seed": 3, **settings}))
    loss_tokens = sum(sum(s.loss_mask) for s in samples)  # the coordinator's count: the mask's sum
    return [trainer.train(protocol.TrainCommand(0, [samples], [loss_tokens])).steps[0] for _ in range(steps)]


def test_tool_tokens_count_nowhere_in_the_loss_and_not_in_the_logprob_comparison(tiny_model_dir: Path) -> None:
    slime_way = multi_turn_samples(tiny_model_dir, 6, seed=4, tool_log_prob=0.0)
    steps = train_steps(tiny_model_dir, slime_way, 2, use_kl_loss=True, kl_loss_coef=0.1, entropy_coef=0.01,
                        use_tis=True)
    # Only the model's tokens are compared with the engine's: within 1e-4 (a tool token's own logprob under the
    # model is far from the 0.0 recorded for it, so comparing it would show).
    assert steps[0].logprob_abs_diff_max <= 1e-4
    assert steps[0].loss_tokens == sum(sum(s.loss_mask) for s in slime_way)
    # Whatever a hook wrote at a tool token — any value, NaN included — the loss and the gradients are the same.
    for value in (-50.0, 3.0, float("nan")):
        other = multi_turn_samples(tiny_model_dir, 6, seed=4, tool_log_prob=value)
        again = train_steps(tiny_model_dir, other, 2, use_kl_loss=True, kl_loss_coef=0.1, entropy_coef=0.01,
                            use_tis=True)
        for ours, theirs in zip(steps, again, strict=True):
            assert (theirs.loss, theirs.grad_norm, theirs.logprob_abs_diff_max, theirs.tis_sum) == (
                ours.loss, ours.grad_norm, ours.logprob_abs_diff_max, ours.tis_sum)


def test_the_loss_at_a_masked_token_is_zero_and_has_no_gradient() -> None:
    config = LossSettings(eps_clip=0.2, eps_clip_high=0.28, use_kl_loss=True, kl_loss_coef=0.5, entropy_coef=0.1,
                        use_tis=True)
    mask = torch.tensor([[1.0, 0.0, 0.0, 1.0]])
    log_probs = torch.tensor([[-1.0, -7.0, -9.0, -2.0]], requires_grad=True)
    entropy = torch.tensor([[1.0, 5.0, 5.0, 1.0]], requires_grad=True)
    kwargs = dict(advantages=torch.tensor([[1.0, 1.0, 1.0, 1.0]]), loss_mask=mask, global_loss_tokens=2,
                  config=config, ref_log_probs=torch.tensor([[-1.5, -1.0, -1.0, -2.5]]))
    loss, sums, _ = policy_loss(log_probs=log_probs, rollout_log_probs=torch.tensor([[-1.1, 0.0, 0.0, -2.1]]),
                                entropy=entropy, **kwargs)
    loss.backward()
    assert log_probs.grad is not None and entropy.grad is not None
    assert log_probs.grad[0, 1:3].abs().sum() == 0 and entropy.grad[0, 1:3].abs().sum() == 0
    assert log_probs.grad[0, 0] != 0 and log_probs.grad[0, 3] != 0
    # The same loss as the two model tokens alone.
    alone, alone_sums, _ = policy_loss(log_probs=log_probs.detach()[:, [0, 3]],
                                       rollout_log_probs=torch.tensor([[-1.1, -2.1]]),
                                       entropy=entropy.detach()[:, [0, 3]],
                                       advantages=torch.tensor([[1.0, 1.0]]), loss_mask=torch.ones(1, 2),
                                       global_loss_tokens=2, config=config,
                                       ref_log_probs=torch.tensor([[-1.5, -2.5]]))
    assert float(loss.detach()) == pytest.approx(float(alone), abs=1e-7)
    assert sums["loss_tokens"] == 2 and sums["kl_sum"] == pytest.approx(alone_sums["kl_sum"])


def test_a_slime_tis_hook_replaces_the_built_in_weight(tiny_model_dir: Path) -> None:
    samples = multi_turn_samples(tiny_model_dir, 6, seed=5, tool_log_prob=0.0)
    for sample in samples:  # engine logprobs a little off, so the weights are not all 1
        sample.rollout_log_probs = [lp - 0.3 * m for lp, m in zip(sample.rollout_log_probs, sample.loss_mask,
                                                                 strict=True)]
    args = {"tis_clip": 1.2, "tis_clip_low": 0.0}
    built_in = train_steps(tiny_model_dir, samples, 1, use_tis=True, tis_clip=1.2)[0]
    hooked = train_steps(tiny_model_dir, samples, 1, use_tis=True, tis_clip=1.2,
                         tis_function_path="tests.support.tis_hooks:vanilla", hook_args=args)[0]
    assert hooked.loss == pytest.approx(built_in.loss, abs=1e-6)
    assert hooked.grad_norm == pytest.approx(built_in.grad_norm, rel=1e-5)
    # its metrics are summed over the loss tokens: clipped tokens counted as the built-in counts them
    assert hooked.extra["tis_hook/tis_clipfrac"] == built_in.tis_clipped_tokens > 0
    assert set(hooked.extra) == {"tis_hook/tis", "tis_hook/tis_clipfrac"}
    # A hook's rejected tokens leave the loss; the logprob comparison still covers every model token.
    rejected = train_steps(tiny_model_dir, samples, 1, use_tis=True,
                           tis_function_path="tests.support.tis_hooks:reject_first", hook_args={})[0]
    plain = train_steps(tiny_model_dir, samples, 1, use_tis=True, tis_clip=1e9)[0]
    assert rejected.loss != plain.loss and rejected.loss_tokens == plain.loss_tokens
    assert rejected.logprob_abs_diff_max == plain.logprob_abs_diff_max


def test_dual_clip_caps_a_negative_advantages_loss_at_c_times_its_advantage() -> None:
    """slime's dual-clip PPO (`--eps-clip-c`): pg = max(-A·r, -A·clip(r)) as always, then where A < 0,
    min(pg, -c·A): a token far off-policy with a negative advantage no longer pushes its loss (and gradient) up
    without bound; positive advantages and ratios under c are untouched."""
    rollout = torch.zeros(1, 4)
    advantages = torch.tensor([[-1.0, -1.0, 1.0, -2.0]])
    log_probs = torch.tensor([[math.log(5.0), math.log(2.0), math.log(5.0), 0.0]], requires_grad=True)
    mask = torch.ones(1, 4)
    common = dict(rollout_log_probs=rollout, advantages=advantages, loss_mask=mask, global_loss_tokens=4,
                  entropy=torch.zeros(1, 4))
    plain, plain_sums, _ = policy_loss(log_probs=log_probs, config=LossSettings(eps_clip=0.2), **common)
    dual, dual_sums, _ = policy_loss(log_probs=log_probs, config=LossSettings(eps_clip=0.2, eps_clip_c=3.0), **common)
    # per token without dual-clip: r = 5, 2, 5, 1 → 5, 2, -1.2, 2; with c = 3 the first (A = -1, 5 > 3) is 3
    assert math.isclose(float(plain.detach()), (5 + 2 - 1.2 + 2) / 4, rel_tol=1e-6)
    assert math.isclose(float(dual.detach()), (3 + 2 - 1.2 + 2) / 4, rel_tol=1e-6)
    dual.backward()
    assert log_probs.grad is not None and log_probs.grad[0, 0] == 0 and log_probs.grad[0, 1] != 0
    assert dual_sums["loss_tokens"] == plain_sums["loss_tokens"] == 4
    with pytest.raises(SettingsError, match=r"eps_clip_c \(--eps-clip-c\) 1.0: dual-clip PPO's lower bound"):
        LossSettings(eps_clip_c=1.0)
