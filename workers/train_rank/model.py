"""Loads the Hugging Face causal LM a rank trains (and its frozen reference copy).

Knows nothing about distribution: imports no torch.distributed; `parallel` shards or replicates what
this returns. Invariant: the trained model and the reference are loaded from the same directory with the
same dtype, so at step 0 their logprobs are equal and the KL is exactly zero; a directory whose weights lack a
parameter of the architecture is refused (`MissingWeights`), never filled with fresh weights.
"""

from __future__ import annotations

from typing import Any

import torch

from workers.errors import RaylessError
from workers.train_rank import packed_attention


class MissingWeights(RaylessError, FileNotFoundError):
    """A model directory whose safetensors lack parameters the architecture needs."""


def refuse_missing(path: str, info: dict[str, Any]) -> None:
    """`from_pretrained(..., output_loading_info=True)`'s report → an error when parameters were missing (and
    so initialised at random by transformers)."""
    missing = sorted(info.get("missing_keys") or [])
    if missing:
        raise MissingWeights(f"{path}: its weights lack {len(missing)} of the model's parameters, e.g. "
                             f"{', '.join(missing[:3])} (refused: they would be fresh random weights)")


def load_causal_lm(
    path: str,
    *,
    dtype: torch.dtype,
    device: torch.device,
    attn_implementation: str | None = None,
    trainable: bool = True,
) -> Any:
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    from workers.vlm_processor import vlm_model_type

    # None: per-sample attention over packed rows (`packed_attention`), not sdpa's row × row mask
    kwargs: dict[str, Any] = {"dtype": dtype, "attn_implementation": packed_attention.resolve(attn_implementation)}
    try:
        # a vision-language model (docs/vlm.md): its vision tower is loaded and trained with the language model
        model_class = AutoModelForImageTextToText if vlm_model_type(path) else AutoModelForCausalLM
        model, info = model_class.from_pretrained(path, output_loading_info=True, **kwargs)
    except OSError as exc:
        raise FileNotFoundError(f"cannot load a causal LM from {path!r}: {exc}") from exc
    refuse_missing(path, info)
    model.to(device)
    return prepare_for_training(model, trainable=trainable)


def prepare_for_training(model: Any, *, trainable: bool) -> Any:
    """Train mode (the policy) or eval mode with every weight frozen (the reference, a copy); no KV cache,
    which is for generation (training forwards never reuse it)."""
    if trainable:
        model.train()
    else:
        model.eval()
        model.requires_grad_(False)
    model.config.use_cache = False
    return model


def enable_activation_checkpointing(model: Any) -> None:
    """Recompute each decoder layer's activations in backward (Megatron's `--recompute-*`, HF's gradient
    checkpointing). Non-reentrant: works whether or not the inputs require grad, on CPU and CUDA alike."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5 (the old name is deprecated)
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def activation_checkpointing_on(model: Any) -> bool:
    if hasattr(model, "is_activation_checkpointing"):
        return bool(model.is_activation_checkpointing)
    return bool(model.is_gradient_checkpointing)


def tied_parameter_names(model: Any) -> set[str]:
    """State-dict names that alias another tensor (e.g. lm_head.weight with tied embeddings)."""
    config = getattr(model, "config", None)
    text_config = (
        config.get_text_config() if config is not None and hasattr(config, "get_text_config") else config
    )
    if not getattr(text_config, "tie_word_embeddings", False):
        return set()
    keys = getattr(model, "_tied_weights_keys", None) or {}
    return set(keys) if isinstance(keys, (dict, list, tuple, set)) else set()
