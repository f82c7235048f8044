"""Next-token logprobs and entropy from the final hidden states and the LM head, a chunk of positions at a time
(`--log-probs-chunk-size`, slime's and miles' flag), so no `[tokens, vocabulary]` tensor ever exists whole.

Owns `ChunkedTokenScores` (the autograd function), `chunk_tokens` (what the flag means) and `token_scores`,
which runs a model's forward with its output head replaced, for that forward only, by the chunked scorer: the
head's weight is used inside the model's own forward, so FSDP2's hooks (the root's gather and its gradient
reduction), PEFT wrappers and activation checkpointing see an ordinary forward.

Invariants: each chunk's logits are computed as the head computes them (the head's dtype, then float32), so
the result equals `log_softmax(model(...).logits.float())` gathered at the next token (`token_log_probs`)
to float32 rounding, gradients included; memory is O(chunk × V): forward keeps only the hidden states, and
backward recomputes one chunk's logits at a time. Entropy is differentiable only when asked (`entropy_grad`),
otherwise it is a detached metric computed in the same pass.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch

#: with no chunk size given: the chunk whose float32 logits take at most this many bytes
AUTO_CHUNK_BYTES = 256 * 2**20


def chunk_tokens(chunk_size: int | None, vocab_size: int) -> int | None:
    """Positions per chunk. None (rayless' default): chunks of ≤ AUTO_CHUNK_BYTES of float32 logits; ≤ 0
    (slime's -1): one chunk, the whole micro-batch; > 0: that many positions. None back means one chunk."""
    if chunk_size is None:
        return max(1, AUTO_CHUNK_BYTES // (4 * max(vocab_size, 1)))
    return None if chunk_size <= 0 else chunk_size


def _chunk_logits(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.nn.functional.linear(hidden, weight, bias).float()


def _scratch(rows: int, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
             ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Two [rows, V] float32 tensors every chunk of one pass writes into, for a float32 head on the CPU; None
    elsewhere (the chunk then allocates its own, as the CUDA caching allocator makes cheap). On the CPU a fresh
    chunk-sized tensor is a fresh mmap: ~65k page faults per 256 MiB, zeroed by the kernel, three per chunk —
    a quarter of a chunk's CPU time (2,048 × 32,768: 0.95 → 0.69 CPU-s). Not under grad mode (a double
    backward), where `out=` is refused."""
    if weight.device.type != "cpu" or weight.dtype != torch.float32 or hidden.dtype != weight.dtype \
            or (bias is not None and bias.dtype != weight.dtype) or torch.is_grad_enabled():
        return None
    return (torch.empty((rows, weight.shape[0]), dtype=torch.float32, device=weight.device),
            torch.empty((rows, weight.shape[0]), dtype=torch.float32, device=weight.device))


def _chunk_log_probs(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                     scratch: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One chunk's float32 log-softmax, and a free chunk-sized tensor to write the next step into (None without
    `scratch`). Without scratch the logits are freed as soon as the log-softmax exists (peak: two chunk
    tensors); with it, the logits and the log-softmax are the scratch's — the same kernels (`linear` is `mm` /
    `addmm`, `log_softmax` is `_log_softmax`) written into existing memory, so the values are bit for bit
    those of `log_softmax(linear(...))`."""
    if scratch is None:
        logits = _chunk_logits(hidden, weight, bias)
        log_p = torch.log_softmax(logits, dim=-1)
        del logits
        return log_p, None
    logits, log_p = (tensor[: hidden.shape[0]] for tensor in scratch)
    if bias is None:
        torch.mm(hidden, weight.t(), out=logits)
    else:
        torch.addmm(bias, hidden, weight.t(), out=logits)
    torch.ops.aten._log_softmax.out(logits, -1, False, out=log_p)
    return log_p, logits


class ChunkedTokenScores(torch.autograd.Function):
    """(hidden [N, H], weight [V, H], bias [V] | None, targets [N]) → (logprob [N], entropy [N]), float32.

    `entropy`: 0 not computed (zeros), 1 a detached metric, 2 differentiable."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                targets: torch.Tensor, chunk: int, entropy: int) -> tuple[torch.Tensor, torch.Tensor]:
        log_probs = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        entropies = torch.zeros_like(log_probs)
        with torch.no_grad():
            scratch = _scratch(min(chunk, hidden.shape[0]), hidden, weight, bias)
            for start in range(0, hidden.shape[0], chunk):
                end = min(start + chunk, hidden.shape[0])
                # The logprobs are log_softmax's whether or not the entropy is asked for: the engine's
                # true-on-policy rescoring asks for none, the trainer for the metric, and the two must agree bit
                # for bit (a one-`exp` form, z - log Σe, saved ~12% of a chunk but rounded differently).
                log_p, free = _chunk_log_probs(hidden[start:end], weight, bias, scratch)
                log_probs[start:end] = log_p.gather(-1, targets[start:end].unsqueeze(-1)).squeeze(-1)
                if entropy:  # -sum p log p, p written over the spent logits (no third chunk-sized tensor)
                    probs = log_p.exp() if free is None else torch.exp(log_p, out=free)
                    entropies[start:end] = -probs.mul_(log_p).sum(-1)
                    del probs
                del log_p, free
            del scratch
        ctx.save_for_backward(hidden, weight, bias, targets, entropies)
        ctx.chunk = chunk
        ctx.set_materialize_grads(False)
        if entropy < 2:
            ctx.mark_non_differentiable(entropies)
        return log_probs, entropies

    @staticmethod
    def backward(ctx: Any, grad_log_probs: torch.Tensor | None, grad_entropy: torch.Tensor | None
                 ) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, bias, targets, entropy = ctx.saved_tensors
        if grad_log_probs is None and grad_entropy is None:
            return None, None, None, None, None, None
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        grad_hidden = torch.zeros_like(hidden) if need_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_weight else None
        grad_bias = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) if need_bias else None
        scratch = _scratch(min(ctx.chunk, hidden.shape[0]), hidden, weight, bias)
        for start in range(0, hidden.shape[0], ctx.chunk):
            end = min(start + ctx.chunk, hidden.shape[0])
            log_p, free = _chunk_log_probs(hidden[start:end], weight, bias, scratch)
            probs = log_p.exp() if free is None else torch.exp(log_p, out=free)
            del free
            # d entropy / d z_j = -p_j (log p_j + H);  d log p_t / d z_j = [j = t] - p_j. In place, one pass each.
            scale = None if grad_log_probs is None else grad_log_probs[start:end].unsqueeze(-1)
            if grad_entropy is not None:
                grad = log_p.add_(entropy[start:end].unsqueeze(-1)).mul_(probs)
                grad.mul_(-grad_entropy[start:end].unsqueeze(-1))
                if scale is not None:
                    grad.addcmul_(probs, scale, value=-1.0)
                del probs
            else:
                del log_p
                grad = probs.mul_(-scale)
            if scale is not None:
                grad.scatter_add_(-1, targets[start:end].unsqueeze(-1), scale)
            if grad_hidden is not None:
                grad_hidden[start:end] = (grad.to(weight.dtype) @ weight).to(hidden.dtype)
            if grad_weight is not None:
                grad_weight.addmm_(grad.t(), hidden[start:end].float())
            if grad_bias is not None:
                grad_bias.add_(grad.sum(0))
            del grad
        del scratch
        return (grad_hidden, None if grad_weight is None else grad_weight.to(weight.dtype),
                None if grad_bias is None else grad_bias.to(weight.dtype), None, None, None)


def scores_from_hidden(hidden: torch.Tensor, head: torch.nn.Linear, targets: torch.Tensor, *, chunk: int | None,
                       entropy: int, scored: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., H] hidden states and [...] targets → ([...] logprob, [...] entropy), float32 (`entropy` as in
    `ChunkedTokenScores`). `scored` [...] bool: only those positions are computed; the others are 0."""
    shape = targets.shape
    flat = hidden.reshape(-1, hidden.shape[-1])
    flat_targets = targets.reshape(-1)
    index = None if scored is None else scored.reshape(-1).nonzero().squeeze(-1)
    if index is not None:
        flat, flat_targets = flat.index_select(0, index), flat_targets.index_select(0, index)
    log_probs, entropies = ChunkedTokenScores.apply(flat, head.weight, head.bias, flat_targets,
                                                    chunk or max(flat.shape[0], 1), entropy)
    if index is not None:
        size = targets.numel()
        log_probs = log_probs.new_zeros(size).index_put((index,), log_probs)
        entropies = entropies.new_zeros(size).index_put((index,), entropies)
    return log_probs.view(shape), entropies.view(shape)


def output_head(model: Any) -> torch.nn.Linear | None:
    """The model's LM head when it is a plain linear layer whose output is the logits (Qwen2/3, Llama, ...);
    None for a head this cannot score in chunks (a wrapped or soft-capped head): the caller then takes the
    full logits."""
    getter = getattr(model, "get_output_embeddings", None)
    head = getter() if callable(getter) else None
    if type(head) is not torch.nn.Linear:
        return None
    config = getattr(model, "config", None)
    text_config = config.get_text_config() if config is not None and hasattr(config, "get_text_config") else config
    for name in ("final_logit_softcapping", "logit_scale", "logits_scaling"):
        if getattr(text_config, name, None) not in (None, 1, 1.0):
            return None
    return head


@contextmanager
def _head_scoring(head: torch.nn.Linear, targets: torch.Tensor, scored: torch.Tensor | None, chunk: int | None,
                  entropy: int, into: list[tuple[torch.Tensor, torch.Tensor]]) -> Iterator[None]:
    def forward(hidden: torch.Tensor) -> torch.Tensor:
        into.append(scores_from_hidden(hidden, head, targets, chunk=chunk, entropy=entropy, scored=scored))
        return hidden.new_zeros((*hidden.shape[:-1], 0))  # the model's "logits": nothing vocabulary-sized

    head.forward = forward  # type: ignore[method-assign]
    try:
        yield
    finally:
        del head.forward


def token_log_probs(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """[B, L, V] logits → [B, L-1] logprob of each next token, in float32."""
    log_probs = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    return log_probs.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)


def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """[B, L, V] logits → [B, L-1] entropy of each next-token distribution."""
    log_probs = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    return -(log_probs.exp() * log_probs).sum(-1)


def token_scores(model: Any, *, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                 position_ids: torch.Tensor | None = None, chunk_size: int | None = None, with_entropy: bool = True,
                 entropy_grad: bool = False, scored: torch.Tensor | None = None,
                 vision: Mapping[str, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[B, L] inputs → ([B, L-1] logprob of each next token, [B, L-1] entropy or None), float32; position t
    scores token t + 1, as `token_log_probs`. `scored` [B, L-1] bool: the positions wanted (the
    responses; a prompt's logprobs are never used), the others 0 and never computed. `vision`: a
    vision-language model's image inputs (`pixel_values`, `image_grid_thw`), passed to its forward as they are
    (`position_ids` then the model's multimodal [3, B, L] ones)."""
    head = output_head(model)
    extra = dict(vision or {})
    if head is None:
        logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                       **extra).logits
        log_probs = token_log_probs(logits, input_ids)
        if not with_entropy:
            return log_probs, None
        if entropy_grad:
            return log_probs, token_entropy(logits)
        with torch.no_grad():
            return log_probs, token_entropy(logits.detach())
    # Position t's target is token t + 1; the last position's (no next token) is dropped below.
    targets = torch.cat([input_ids[:, 1:], input_ids[:, :1]], dim=1)
    wanted = None if scored is None else torch.cat([scored.bool(), scored.new_zeros((scored.shape[0], 1)).bool()], 1)
    results: list[tuple[torch.Tensor, torch.Tensor]] = []
    chunk = chunk_tokens(chunk_size, head.weight.shape[0])
    with _head_scoring(head, targets, wanted, chunk, (2 if entropy_grad else 1) if with_entropy else 0, results):
        model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, **extra)
    if len(results) != 1:
        raise RuntimeError(f"{type(model).__name__}'s forward called its output head {len(results)} times, not once")
    log_probs, entropy = results[0]
    return log_probs[:, :-1], entropy[:, :-1] if with_entropy else None
