"""PPO's value model on the training ranks: the policy's architecture with its LM head replaced by a value head
(`Linear(hidden, 1)`, zero-initialised: every value starts at 0), sharded or replicated as the policy, with
its own Adam and learning rate; and slime's clipped value loss.

Owns `Critic` (build, old values, one training step, its state for checkpoints) and `value_loss`. The loss is
slime's `value_loss_function`: with `V_old` the values before the rollout's first update and `G` the GAE returns,
`max((V_old + clip(V - V_old, ±value_clip) - G)², (V - G)²)` per token; reduced as rayless' policy loss is, a
token sum over the loss mask divided by the step's loss tokens over all ranks (`loss` module's invariant).

Invariants: the value at shifted position t (the hidden state after token t) is the value of the state in which
token t + 1 was generated, the layout of every other per-token tensor (`batching`); every rank runs the
critic's step with the policy's micro-batches, so a sharded critic meets its collectives as the policy does.
"""

from __future__ import annotations

from typing import Any

import torch

from workers.protocol.train_settings import CriticSettings, TrainSettings
from workers.train_rank.batching import MicroBatch
from workers.train_rank.model import enable_activation_checkpointing, load_causal_lm
from workers.train_rank.optim import LrSchedule, build_optimizer, build_scheduler, clip_gradients
from workers.train_rank.parallel import FullySharded, Replicated, shard_model, use_fsdp
from workers.train_rank.placement import load_sharded

#: the step metrics a critic adds (token sums over the loss mask; the coordinator divides by the loss tokens)
METRICS = ("critic/value_loss", "critic/value_clipfrac", "critic/values", "critic/returns")


def attach_value_head(model: Any) -> None:
    """Replace the LM head by a zero-initialised `Linear(hidden, 1)`: the model's "logits" are now values."""
    hidden = model.get_output_embeddings().weight.shape[1]
    reference = model.get_output_embeddings().weight
    head = torch.nn.Linear(hidden, 1, bias=False, dtype=reference.dtype, device=reference.device)
    if reference.device.type != "meta":
        torch.nn.init.zeros_(head.weight)
    model.set_output_embeddings(head)
    model.config.tie_word_embeddings = False  # the head is the critic's own, never the embeddings


def value_loss(*, values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, loss_mask: torch.Tensor,
               value_clip: float, global_loss_tokens: int) -> tuple[torch.Tensor, dict[str, float]]:
    """slime's clipped value loss (module docstring) → (loss to backward, token sums of the metrics)."""
    clipped = old_values + (values - old_values).clamp(-value_clip, value_clip)
    per_token = torch.maximum((clipped - returns).square(), (values - returns).square())
    loss = (per_token * loss_mask).sum() / float(max(global_loss_tokens, 1))
    with torch.no_grad():
        sums = {
            "critic/value_loss": float((per_token * loss_mask).sum()),
            "critic/value_clipfrac": float((((values - old_values).abs() > value_clip).float() * loss_mask).sum()),
            "critic/values": float((values.detach() * loss_mask).sum()),
            "critic/returns": float((returns * loss_mask).sum()),
        }
    return loss, sums


class Critic:
    """The value model, its optimizer and schedule on one rank."""

    def __init__(self, settings: TrainSettings, device: torch.device) -> None:
        critic = settings.critic
        assert critic is not None
        self.settings: CriticSettings = critic
        self.device = device
        self.model = self._build(settings, device)
        self.parallel: Any = (FullySharded(self.model, device) if use_fsdp(settings.parallel.data_parallel, device)
                              else Replicated(self.model))
        optimizer = settings.optimizer
        self.optimizer = build_optimizer(self.model, lr=critic.lr, weight_decay=optimizer.weight_decay,
                                         betas=(optimizer.adam_beta1, optimizer.adam_beta2), eps=optimizer.adam_eps)
        self.scheduler = build_scheduler(self.optimizer, LrSchedule(lr=critic.lr, warmup_steps=critic.warmup_steps))
        self.clip_grad = optimizer.clip_grad
        if critic.load_path is not None:
            from workers.train_rank import checkpoint

            checkpoint.load_critic_weights(critic.load_path, self.model)

    @staticmethod
    def _build(settings: TrainSettings, device: torch.device) -> Any:
        model_settings = settings.model
        dtype = getattr(torch, model_settings.dtype)
        if not use_fsdp(settings.parallel.data_parallel, device):
            model = load_causal_lm(model_settings.path, dtype=dtype, device=device,
                                   attn_implementation=model_settings.attn_implementation, trainable=True)
            attach_value_head(model)
            if model_settings.gradient_checkpointing:
                enable_activation_checkpointing(model)
            return model
        compute_dtype = getattr(torch, model_settings.compute_dtype) if model_settings.compute_dtype else None

        def shard(model: Any) -> None:
            if model_settings.gradient_checkpointing:
                enable_activation_checkpointing(model)
            shard_model(model, device=device, compute_dtype=compute_dtype)

        return load_sharded(model_settings.path, dtype=dtype, device=device, shard=shard,
                            attn_implementation=model_settings.attn_implementation, trainable=True,
                            adapt=attach_value_head, adapt_full=attach_value_head)

    def values(self, batch: MicroBatch) -> torch.Tensor:
        """[B, L-1] float32 values at the shifted positions (0 outside the responses). A vision-language batch's
        images go in as the policy's do (`batch.vision`): the value of a state after an image is read from the
        image, and the critic's tower trains with it."""
        out = self.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                         position_ids=batch.position_ids, **(batch.vision or {})).logits
        return out[:, :-1, 0].float() * batch.response_positions()

    @torch.no_grad()
    def old_values(self, batch: MicroBatch) -> torch.Tensor:
        return self.values(batch)

    def train_step(self, batches: list[MicroBatch], global_tokens: int) -> dict[str, float]:
        """One optimizer step of the critic over this rank's part of the step; returns its metric sums."""
        self.optimizer.zero_grad(set_to_none=True)
        sums: dict[str, float] = dict.fromkeys(METRICS, 0.0)
        for batch in batches:
            assert batch.old_values is not None and batch.returns is not None
            loss, batch_sums = value_loss(values=self.values(batch), old_values=batch.old_values,
                                          returns=batch.returns, loss_mask=batch.loss_mask,
                                          value_clip=self.settings.value_clip, global_loss_tokens=global_tokens)
            loss.backward()
            for key, value in batch_sums.items():
                sums[key] += value
        self.parallel.reduce_gradients()
        clip_gradients(self.model, self.clip_grad)
        self.optimizer.step()
        self.scheduler.step()
        return sums
