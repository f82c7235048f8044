"""PPO's critic and per-token returns on the rank, in this process: GAE and REINFORCE++'s discounted returns
against independent reference computations, the whitening, the clipped value loss, and a real critic on the
tiny model (packed values equal each sample's own, the value loss falls, a checkpoint resumes it exactly)."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
import torch

from tests.support.train_samples import synthetic_samples
from tests.support.train_settings import flat_settings
from workers import protocol
from workers.protocol.train_settings import CriticSettings, MemorySettings, ReturnsSettings, SettingsError
from workers.train_rank import checkpoint, packing, returns
from workers.train_rank.critic import value_loss
from workers.train_rank.trainer import Trainer

torch.set_num_threads(1)


def reference_gae(rewards: list[float], values: list[float], gamma: float, lambd: float
                  ) -> tuple[list[float], list[float]]:
    """The closed form: A_t = Σ_l (γλ)^l δ_{t+l}, δ_t = r_t + γ V_{t+1} - V_t (V_T = 0); G_t = A_t + V_t."""
    length = len(rewards)
    deltas = [rewards[t] + gamma * (values[t + 1] if t + 1 < length else 0.0) - values[t] for t in range(length)]
    advantages = [math.fsum((gamma * lambd) ** (k - t) * deltas[k] for k in range(t, length)) for t in range(length)]
    return advantages, [a + v for a, v in zip(advantages, values, strict=True)]


def reference_discounted(rewards: list[float], gamma: float) -> list[float]:
    return [math.fsum(gamma ** (k - t) * rewards[k] for k in range(t, len(rewards))) for t in range(len(rewards))]


@pytest.mark.parametrize("gamma,lambd", [(1.0, 1.0), (0.99, 0.95), (0.9, 0.0), (0.0, 0.5), (0.7, 1.0)])
def test_gae_equals_the_closed_form_on_random_rewards_and_values(gamma: float, lambd: float) -> None:
    rng = random.Random(hash((gamma, lambd)) & 0xFFFF)
    for _ in range(20):
        length = rng.randint(1, 40)
        rewards = [rng.uniform(-2, 2) for _ in range(length)]
        values = [rng.uniform(-2, 2) for _ in range(length)]
        advantages, targets = returns.gae(torch.tensor(rewards), torch.tensor(values), gamma=gamma, lambd=lambd)
        assert advantages.dtype == torch.float32 and advantages.shape == (length,)
        # the reference on the same float32 inputs the rank has
        want_a, want_g = reference_gae(torch.tensor(rewards).double().tolist(),
                                       torch.tensor(values).double().tolist(), gamma, lambd)
        assert max(abs(a - b) for a, b in zip(advantages.tolist(), want_a, strict=True)) <= 1e-6
        assert max(abs(a - b) for a, b in zip(targets.tolist(), want_g, strict=True)) <= 1e-6


def test_ppo_rewards_sit_on_the_responses_last_token_as_slime() -> None:
    assert returns.token_rewards(2.5, 4).tolist() == [0.0, 0.0, 0.0, 2.5]
    # γ = λ = 1: every token's advantage is the reward minus its own value (the critic's baseline)
    advantages, targets = returns.gae(returns.token_rewards(1.0, 3), torch.tensor([0.2, 0.5, 0.9]),
                                      gamma=1.0, lambd=1.0)
    assert advantages.tolist() == pytest.approx([0.8, 0.5, 0.1]) and targets.tolist() == pytest.approx([1.0] * 3)


@pytest.mark.parametrize("gamma", [1.0, 0.95, 0.5, 0.0])
def test_reinforce_plus_plus_returns_equal_the_discounted_sum(gamma: float) -> None:
    rng = random.Random(int(gamma * 100))
    for _ in range(20):
        length = rng.randint(1, 30)
        mask = [rng.random() < 0.7 for _ in range(length)]
        reward = rng.uniform(-1, 1)
        got = returns.reinforce_returns(reward, torch.tensor(mask, dtype=torch.float32), gamma=gamma)
        if not any(mask):
            assert got.tolist() == [0.0] * length
            continue
        last = max(i for i, kept in enumerate(mask) if kept)  # slime: the reward on the last loss token
        rewards = [reward if i == last else 0.0 for i in range(length)]
        assert max(abs(a - b) for a, b in zip(got.tolist(), reference_discounted(rewards, gamma), strict=True)) <= 1e-6
        arbitrary = [rng.uniform(-1, 1) for _ in range(length)]
        discounted = returns.discounted_returns(torch.tensor(arbitrary, dtype=torch.float64), gamma=gamma)
        assert max(abs(a - b) for a, b in zip(discounted.tolist(), reference_discounted(arbitrary, gamma),
                                              strict=True)) <= 1e-6


def test_whitening_uses_the_masked_tokens_mean_and_bessel_variance() -> None:
    rng = random.Random(5)
    values = [torch.tensor([rng.uniform(-3, 3) for _ in range(n)]) for n in (5, 7, 3)]
    masks = [torch.tensor([float(rng.random() < 0.6) for _ in range(len(v))]) for v in values]
    masks[0][0] = 1.0
    masks[1][0] = 1.0
    kept = [float(v[i]) for v, m in zip(values, masks, strict=True) for i in range(len(v)) if m[i]]
    mean = math.fsum(kept) / len(kept)
    std = math.sqrt(math.fsum((x - mean) ** 2 for x in kept) / (len(kept) - 1) + returns.WHITEN_EPSILON)
    for got, value in zip(returns.whiten(values, masks), values, strict=True):
        assert got.tolist() == pytest.approx([(float(x) - mean) / std for x in value], abs=1e-6)


def test_value_loss_is_slimes_clipped_maximum() -> None:
    values = torch.tensor([[0.0, 1.0, 0.5, 2.0]], requires_grad=True)
    old = torch.tensor([[0.0, 0.5, 0.5, 0.0]])
    target = torch.tensor([[1.0, 1.0, 0.0, 3.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    loss, sums = value_loss(values=values, old_values=old, returns=target, loss_mask=mask, value_clip=0.2,
                            global_loss_tokens=6)
    # token 0: (0-1)² both; token 1: clipped 0.7 → 0.09 vs 0 → 0.09; token 2: 0.25 both; token 3 masked
    assert sums["critic/value_loss"] == pytest.approx(1.0 + 0.09 + 0.25)
    assert float(loss.detach()) == pytest.approx((1.0 + 0.09 + 0.25) / 6)
    assert sums["critic/value_clipfrac"] == 1.0
    loss.backward()
    assert values.grad is not None and float(values.grad[0, 1]) == 0.0  # the clipped branch carries no gradient


def test_settings_hold_the_critic_with_ppo_only() -> None:
    model = {"model_path": "/m"}
    with pytest.raises(SettingsError, match="a critic is trained exactly when"):
        flat_settings(model).replace(critic=CriticSettings(lr=1e-3))
    with pytest.raises(SettingsError, match=r"returns\.gamma must be in"):
        ReturnsSettings(estimator="ppo", gamma=1.5)


def ppo_settings(model_dir: Path, *, normalize: bool = False, critic_only: int = 0) -> protocol.InitCommand:
    settings = flat_settings({"model_path": str(model_dir), "lr": 1e-3, "max_tokens_per_micro_batch": 48, "seed": 3})
    settings = settings.replace(returns=ReturnsSettings(estimator="ppo", gamma=0.9, lambd=0.8, normalize=normalize),
                                critic=CriticSettings(lr=2e-3, critic_only_steps=critic_only))
    return protocol.InitCommand(settings)


def rewarded(samples: list[protocol.WireSample]) -> list[protocol.WireSample]:
    """The samples with a reward each (PPO's wire: the scalar reward in `advantage`)."""
    return [protocol.WireSample(tokens=s.tokens, response_length=s.response_length, loss_mask=s.loss_mask,
                                rollout_log_probs=s.rollout_log_probs, advantage=float(i % 3 == 0))
            for i, s in enumerate(samples)]


def test_packed_gae_equals_each_samples_own_and_the_critic_learns(tiny_model_dir: Path) -> None:
    samples = rewarded(synthetic_samples(tiny_model_dir, 6, seed=4))
    trainer = Trainer(rank=0, world_size=1, device=torch.device("cpu"))
    trainer.init(ppo_settings(tiny_model_dir))
    assert trainer.critic is not None
    batches = [trainer._micro_batches(samples)]
    assert len(batches[0]) > 1 and any(len(b.spans) > 1 for b in batches[0])  # packed rows of several samples
    # a fresh value head: every value 0, so the first advantages are the discounted rewards
    trainer._token_advantages(batches)
    for batch in batches[0]:
        assert batch.old_values is not None and float(batch.old_values.abs().max()) == 0.0
    # after a few critic steps the packed values are each sample's own values, alone in its row
    tokens = sum(sum(s.loss_mask) for s in samples)
    losses = [trainer.critic.train_step(batches[0], tokens)["critic/value_loss"] for _ in range(6)]
    assert losses[-1] < 0.75 * losses[0], losses  # bounded below: the clip keeps V within 0.2 of V_old = 0
    batches = [trainer._micro_batches(samples)]  # the samples' rewards again (advantages replace them in place)
    trainer._token_advantages(batches)
    groups = packing.plan(samples, max_tokens=48, micro_batch_size=None)
    for batch, group in zip(batches[0], groups, strict=True):
        for (start, end), index in zip(batch.spans, group, strict=True):
            sample = samples[index]
            alone = trainer._micro_batches([sample])[0]
            values = trainer.critic.old_values(alone).view(-1)[alone.spans[0][0]:alone.spans[0][1]]
            assert batch.old_values is not None and batch.returns is not None
            torch.testing.assert_close(batch.old_values.view(-1)[start:end], values, atol=1e-5, rtol=1e-5)
            want_a, want_g = reference_gae([0.0] * (end - start - 1) + [sample.advantage], values.double().tolist(),
                                           0.9, 0.8)
            assert batch.advantages.view(-1)[start:end].tolist() == pytest.approx(want_a, abs=1e-5)
            assert batch.returns.view(-1)[start:end].tolist() == pytest.approx(want_g, abs=1e-5)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")  # DCP in one process
def test_critic_only_steps_leave_the_policy_and_a_checkpoint_resumes_the_critic_exactly(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    samples = rewarded(synthetic_samples(tiny_model_dir, 4, seed=6))
    tokens = [sum(sum(s.loss_mask) for s in samples)]

    def train(trainer: Trainer, rollout_id: int) -> protocol.StepMetrics:
        return trainer.train(protocol.TrainCommand(rollout_id, [samples], tokens)).steps[0]

    trainer = Trainer(rank=0, world_size=1, device=torch.device("cpu"))
    trainer.init(ppo_settings(tiny_model_dir, normalize=True, critic_only=1))
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    first = train(trainer, 0)  # critic only: the policy is untouched, the critic trained
    assert first.pg_loss == 0.0 and first.extra["critic/value_loss"] > 0
    assert all(torch.equal(before[k], v) for k, v in trainer.model.state_dict().items())
    train(trainer, 1)
    assert any(not torch.equal(before[k], v) for k, v in trainer.model.state_dict().items())
    trainer.save(protocol.SaveCommand(directory=str(tmp_path / "ckpt"), rollout_id=1, extra={}))
    assert (tmp_path / "ckpt" / "rollout_1" / checkpoint.CRITIC_SCHEDULER).is_file()
    assert trainer.critic is not None
    saved_critic = {k: v.clone() for k, v in trainer.critic.model.state_dict().items()}
    continued = [train(trainer, 2), train(trainer, 3)]

    resumed = Trainer(rank=0, world_size=1, device=torch.device("cpu"))
    resumed.init(ppo_settings(tiny_model_dir, normalize=True, critic_only=1))
    resumed.load(protocol.LoadCommand(path=str(tmp_path / "ckpt")))
    again = [train(resumed, 2), train(resumed, 3)]
    for one, two in zip(continued, again, strict=True):
        assert (one.loss, one.grad_norm, one.extra) == (two.loss, two.grad_norm, two.extra)
    assert resumed.critic is not None and trainer.critic is not None
    for (name, mine), theirs in zip(trainer.critic.model.state_dict().items(),
                                    resumed.critic.model.state_dict().values(), strict=True):
        assert torch.equal(mine, theirs), name

    # --critic-load: a fresh run's critic from that checkpoint (its weights, the optimizer fresh)
    loaded = Trainer(rank=0, world_size=1, device=torch.device("cpu"))
    command = ppo_settings(tiny_model_dir)
    critic = command.settings.critic
    assert critic is not None
    loaded.init(protocol.InitCommand(command.settings.replace(
        critic=CriticSettings(lr=critic.lr, load_path=str(tmp_path / "ckpt" / "rollout_1")))))
    assert loaded.critic is not None
    for name, tensor in loaded.critic.model.state_dict().items():
        assert torch.equal(tensor, saved_critic[name]), name
    assert float(saved_critic["lm_head.weight"].abs().max()) > 0  # a trained head, not the fresh zero one


def test_colocation_offloads_the_critic_with_the_policy_and_brings_it_back_bit_identical(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    samples = rewarded(synthetic_samples(tiny_model_dir, 4, seed=7))
    command = ppo_settings(tiny_model_dir)
    settings = command.settings.replace(memory=MemorySettings(offload_dir=str(tmp_path)))
    trainer = Trainer(rank=0, world_size=1, device=torch.device("cpu"))
    trainer.init(protocol.InitCommand(settings))
    trainer.train(protocol.TrainCommand(0, [samples], [sum(sum(s.loss_mask) for s in samples)]))
    assert trainer.critic is not None and trainer.state is not None
    critic_before = {k: v.clone() for k, v in trainer.critic.model.state_dict().items()}
    assert any(name.startswith("critic/") for name in trainer.state.tensors())
    assert any(name.startswith("critic_optimizer/") for name in trainer.state.tensors())
    out = trainer.offload(protocol.OffloadCommand(verify=True))
    assert all(p.numel() == 0 for p in trainer.critic.model.parameters())  # its storage is gone too
    back = trainer.onload(protocol.OnloadCommand(verify=True))
    assert back.digest == out.digest
    for name, tensor in trainer.critic.model.state_dict().items():
        assert torch.equal(tensor, critic_before[name]), name


def test_reinforce_plus_plus_with_gamma_discounts_each_packed_response_and_whitens(tiny_model_dir: Path) -> None:
    samples = rewarded(synthetic_samples(tiny_model_dir, 6, seed=8))
    settings = flat_settings({"model_path": str(tiny_model_dir), "max_tokens_per_micro_batch": 48})
    trainer = Trainer(rank=0, world_size=1, device=torch.device("cpu"))
    trainer.init(protocol.InitCommand(settings.replace(
        returns=ReturnsSettings(estimator="reinforce_plus_plus", gamma=0.8, normalize=True))))
    assert trainer.critic is None
    batches = [trainer._micro_batches(samples)]
    trainer._token_advantages(batches)
    groups = packing.plan(samples, max_tokens=48, micro_batch_size=None)
    raw: list[float] = []
    got: list[float] = []
    for batch, group in zip(batches[0], groups, strict=True):
        for (start, end), index in zip(batch.spans, group, strict=True):
            mask = samples[index].loss_mask
            last = max(i for i, kept in enumerate(mask) if kept)
            returns_ = reference_discounted([samples[index].advantage if i == last else 0.0
                                             for i in range(len(mask))], 0.8)
            raw += [r for r, kept in zip(returns_, mask, strict=True) if kept]
            got += [float(a) for a, kept in zip(batch.advantages.view(-1)[start:end], mask, strict=True) if kept]
    mean = math.fsum(raw) / len(raw)
    std = math.sqrt(math.fsum((x - mean) ** 2 for x in raw) / (len(raw) - 1) + returns.WHITEN_EPSILON)
    assert got == pytest.approx([(x - mean) / std for x in raw], abs=1e-5)
