"""The Tinker service's two training commands on a rank: forward(/backward) with Tinker's built-in losses, and
an Adam step with the parameters the client sends.

Owns `forward_backward` and `optim_step`. The losses are Tinker's (tinker-docs "Loss Functions"), sums over
the positions of every datum, with `logp` the trainer's logprob of `target_tokens[i]` after `tokens[:i+1]`:
cross_entropy `-Σ w·logp`; importance_sampling `-Σ exp(logp - q)·A` (q: the sampler's logprobs);
ppo `-Σ min(r·A, clip(r, clip_low_threshold, clip_high_threshold)·A)`, r = exp(logp - q), thresholds 0.8 / 1.2
unless the client sends others. Invariants: gradients accumulate over `forward_backward` calls and are summed
over ranks (`reduce_gradients`) only in `optim_step`, which clears them; a forward-only call leaves them as
they were; each datum is its own forward (no padding enters a logprob).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from workers import protocol
from workers.shared_torch.token_scores import token_scores
from workers.train_rank.optim import clip_gradients

#: Tinker's built-in losses the ranks compute (the service refuses the others by name before sending)
LOSSES = ("cross_entropy", "importance_sampling", "ppo")
PPO_CLIP = (0.8, 1.2)


def _target_log_probs(model: Any, datum: protocol.TinkerDatum, device: torch.device) -> torch.Tensor:
    """[N] float32: logprob of `target_tokens[i]` after `tokens[:i+1]`. The usual shifted datum (targets =
    tokens[1:] + one more) goes through the chunked scorer; any other targets through the full logits."""
    tokens, targets = datum.tokens, datum.target_tokens
    if tokens[1:] == targets[:-1]:
        ids = torch.tensor([[*tokens, targets[-1]]], dtype=torch.long, device=device)
        return token_scores(model, input_ids=ids, with_entropy=False)[0][0]
    ids = torch.tensor([tokens], dtype=torch.long, device=device)
    logits = model(input_ids=ids).logits[0].float()
    wanted = torch.tensor(targets, dtype=torch.long, device=device)
    return torch.log_softmax(logits, dim=-1).gather(-1, wanted[:, None])[:, 0]


def datum_loss(log_probs: torch.Tensor, datum: protocol.TinkerDatum, loss_fn: str,
               config: dict[str, float]) -> torch.Tensor:
    """[N] per-position loss of one datum (its sum is the datum's loss)."""
    def inputs(values: list[float], name: str) -> torch.Tensor:
        if len(values) != len(datum.tokens):
            raise ValueError(f"{loss_fn} needs loss_fn_inputs[{name!r}] of the datum's length "
                             f"{len(datum.tokens)}, got {len(values)}")
        return torch.tensor(values, dtype=torch.float32, device=log_probs.device)

    if loss_fn == "cross_entropy":
        return -log_probs * inputs(datum.weights, "weights")
    if loss_fn not in ("importance_sampling", "ppo"):
        raise ValueError(f"the ranks compute {', '.join(LOSSES)}, not {loss_fn!r}")
    ratio = torch.exp(log_probs - inputs(datum.logprobs, "logprobs"))
    advantages = inputs(datum.advantages, "advantages")
    if loss_fn == "importance_sampling":
        return -ratio * advantages
    low = config.get("clip_low_threshold", PPO_CLIP[0])
    high = config.get("clip_high_threshold", PPO_CLIP[1])
    return -torch.minimum(ratio * advantages, torch.clamp(ratio, low, high) * advantages)


def forward_backward(model: Any, command: protocol.ForwardBackwardCommand, device: torch.device,
                     rounds: int | None = None) -> protocol.ForwardBackwardReply:
    """`rounds` (sharded ranks: the most data any rank got) > the share: the rank runs that many forwards (and
    backwards), the extra ones on a one-token stand-in whose loss is multiplied by 0, so every rank enters the
    same FSDP collectives; they add nothing to the gradients or the reply."""
    started = time.perf_counter()
    reply = protocol.ForwardBackwardReply()
    for _ in range(len(command.data), rounds or 0):
        with torch.set_grad_enabled(not command.forward_only):
            stand_in = protocol.TinkerDatum(tokens=[0], target_tokens=[0])
            loss = _target_log_probs(model, stand_in, device).sum() * 0.0
            if not command.forward_only:
                loss.backward()
    for datum in command.data:
        if len(datum.tokens) != len(datum.target_tokens) or not datum.tokens:
            raise ValueError(f"a datum needs target_tokens of its model_input's length "
                             f"({len(datum.tokens)}), got {len(datum.target_tokens)}")
        with torch.set_grad_enabled(not command.forward_only):
            log_probs = _target_log_probs(model, datum, device)
            losses = datum_loss(log_probs, datum, command.loss_fn, command.loss_config)
            loss = losses.sum()
            if not command.forward_only:
                loss.backward()
        reply.logprobs.append(log_probs.detach().cpu().tolist())
        reply.elementwise_loss.append(losses.detach().cpu().tolist())
        reply.loss_sum += float(loss.detach())
    reply.seconds = time.perf_counter() - started
    return reply


def optim_step(model: Any, parallel: Any, optimizer: torch.optim.Optimizer,
               command: protocol.OptimStepCommand) -> protocol.OptimStepReply:
    started = time.perf_counter()
    for group in optimizer.param_groups:
        group.update(lr=command.learning_rate, betas=(command.beta1, command.beta2), eps=command.eps,
                     weight_decay=command.weight_decay)
    parallel.reduce_gradients()
    grad_norm = clip_gradients(model, command.grad_clip_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return protocol.OptimStepReply(grad_norm=grad_norm, seconds=time.perf_counter() - started)
