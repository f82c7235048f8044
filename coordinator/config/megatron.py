"""The Megatron-LM slice: flags that slime/miles pass to their Megatron trainer, accepted and not used.

rayless trains Hugging Face models with FSDP2: the architecture comes from `--hf-checkpoint`'s `config.json`,
parallelism is data parallel over the training ranks, kernels are PyTorch's. So a slime or miles launch script
can run unchanged, these flags are parsed here — a flag with a value takes its value (typed and range-checked
like any other), a switch takes none — and `porting.porting_notice` reports them in one grouped notice,
comparing the architecture flags with `config.json`. Megatron flags that have an equivalent here are not in
this slice: they are real flags of the train slice (`--micro-batch-size`, `--bf16`, `--recompute-*`, ...).

Owns `MEGATRON_TABLE` (one row per flag: name, type, category, choices) and the slice built from it. The table
is the one list: a row is a flag; `CATEGORIES` says why each group is not used.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from coordinator.config.fields import Slice, flag

#: category → why its flags are not used (shown in the notice and in `--help`).
CATEGORIES = {
    "architecture": "the model is built from --hf-checkpoint's config.json",
    "parallelism": "training is FSDP2 data parallel over --actor-num-nodes × --actor-num-gpus-per-node ranks",
    "moe": "MoE routing is the Hugging Face model's own (config.json)",
    "kernels": "attention and fused kernels are PyTorch's / the model's attn_implementation",
    "precision": "gradients are reduced and softmax computed in float32 already",
    "optimizer": "the optimizer is torch AdamW; Megatron's distributed/CPU optimizer options have no equivalent",
    "dropout": "dropout comes from config.json (RL scripts set 0.0, as most configs do)",
    "other": "a Megatron training detail with no equivalent here",
    # categories of upstream_flags.tsv (slime/miles flags accepted and not used, each with why)
    "memory": "memory placement is FSDP2's, --offload-train/--offload-rollout and --gradient-checkpointing",
    "logging": "rayless logs its own metrics (--use-wandb, --use-tensorboard, the run directory)",
    "checkpoint": "checkpoints are rayless' own (--save / --load), written synchronously",
    "data": "Megatron's pretraining data pipeline is not used: prompts come from --prompt-data",
    "ci": "a check of slime's / miles' own CI (rayless' tests check rayless)",
    "debug": "a debugging/profiling aid of slime's / miles' stack",
    "ft": "rayless' fault tolerance has its own health checks (--use-fault-tolerance)",
    "cluster": "there is no Ray cluster or object store: data moves over rayless' control channel",
    "async": "--async-rollout bounds staleness with --max-weight-staleness; miles' buffer settings are not used",
    "engine": "an engine-client detail of slime's; rayless' engine client has its own deadlines",
    "weights": "rayless' weights are the Hugging Face model's already",
}

_T = tuple[str, ...]
# (flag name, type, category, choices or None). bool = a switch (store_true/store_false in Megatron).
MEGATRON_TABLE: tuple[tuple[str, Any, str, tuple[Any, ...] | None], ...] = (
    # architecture: compared with config.json where it has the same fact
    ("num_layers", int, "architecture", None),
    ("hidden_size", int, "architecture", None),
    ("ffn_hidden_size", int, "architecture", None),
    ("num_attention_heads", int, "architecture", None),
    ("num_query_groups", int, "architecture", None),
    ("group_query_attention", bool, "architecture", None),
    ("kv_channels", int, "architecture", None),
    ("vocab_size", int, "architecture", None),
    ("make_vocab_size_divisible_by", int, "architecture", None),
    ("max_position_embeddings", int, "architecture", None),
    ("seq_length", int, "architecture", None),
    ("swiglu", bool, "architecture", None),
    ("normalization", str, "architecture", ("LayerNorm", "RMSNorm")),
    ("norm_epsilon", float, "architecture", None),
    ("apply_layernorm_1p", bool, "architecture", None),
    ("qk_layernorm", bool, "architecture", None),
    ("disable_bias_linear", bool, "architecture", None),
    ("add_qkv_bias", bool, "architecture", None),
    ("untie_embeddings_and_output_weights", bool, "architecture", None),
    ("use_rotary_position_embeddings", bool, "architecture", None),
    ("position_embedding_type", str, "architecture", ("learned_absolute", "rope", "yarn", "mrope", "relative",
                                                      "none")),
    ("no_position_embedding", bool, "architecture", None),
    ("rotary_base", float, "architecture", None),
    ("rotary_percent", float, "architecture", None),
    ("rotary_interleaved", bool, "architecture", None),
    ("rotary_scaling_factor", float, "architecture", None),
    ("rope_type", str, "architecture", ("rope", "yarn")),
    ("mscale", float, "architecture", None),
    ("mscale_all_dim", float, "architecture", None),
    ("beta_fast", float, "architecture", None),
    ("beta_slow", float, "architecture", None),
    ("original_max_position_embeddings", int, "architecture", None),
    ("multi_latent_attention", bool, "architecture", None),
    ("q_lora_rank", int, "architecture", None),
    ("kv_lora_rank", int, "architecture", None),
    ("qk_head_dim", int, "architecture", None),
    ("qk_pos_emb_head_dim", int, "architecture", None),
    ("v_head_dim", int, "architecture", None),
    ("attention_output_gate", bool, "architecture", None),
    ("post_self_attn_layernorm", bool, "architecture", None),
    ("post_mlp_layernorm", bool, "architecture", None),
    ("mtp_num_layers", int, "architecture", None),
    ("mtp_loss_scaling_factor", float, "architecture", None),
    ("spec", _T, "architecture", None),
    ("init_method_std", float, "architecture", None),
    ("tokenizer_type", str, "architecture", None),
    ("tokenizer_model", str, "architecture", None),
    # mixture of experts
    ("num_experts", int, "moe", None),
    ("moe_ffn_hidden_size", int, "moe", None),
    ("moe_shared_expert_intermediate_size", int, "moe", None),
    ("moe_layer_freq", str, "moe", None),
    ("moe_router_topk", int, "moe", None),
    ("moe_router_dtype", str, "moe", ("fp32", "fp64")),
    ("moe_router_score_function", str, "moe", ("softmax", "sigmoid", "sqrtsoftplus")),
    ("moe_router_pre_softmax", bool, "moe", None),
    ("moe_router_enable_expert_bias", bool, "moe", None),
    ("moe_router_bias_update_rate", float, "moe", None),
    ("moe_router_num_groups", int, "moe", None),
    ("moe_router_group_topk", int, "moe", None),
    ("moe_router_topk_scaling_factor", float, "moe", None),
    ("moe_router_load_balancing_type", _T, "moe", ("aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn",
                                                   "quantile_balancing", "none")),
    ("moe_aux_loss_coeff", tuple[float, ...], "moe", None),
    ("moe_token_dispatcher_type", str, "moe", ("allgather", "alltoall", "flex")),
    ("moe_token_drop_policy", str, "moe", ("probs", "position")),
    # parallelism
    ("tensor_model_parallel_size", int, "parallelism", None),
    ("pipeline_model_parallel_size", int, "parallelism", None),
    ("context_parallel_size", int, "parallelism", None),
    ("expert_model_parallel_size", int, "parallelism", None),
    ("expert_tensor_parallel_size", int, "parallelism", None),
    ("decoder_first_pipeline_num_layers", int, "parallelism", None),
    ("decoder_last_pipeline_num_layers", int, "parallelism", None),
    ("sequence_parallel", bool, "parallelism", None),
    ("cp_comm_type", _T, "parallelism", ("p2p", "a2a", "allgather", "a2a+p2p")),
    ("use_distributed_optimizer", bool, "parallelism", None),
    # kernels and fusion
    ("attention_backend", str, "kernels", ("flash", "fused", "unfused", "local", "auto")),
    ("transformer_impl", str, "kernels", ("local", "transformer_engine")),
    ("use_flash_attn", bool, "kernels", None),
    ("moe_grouped_gemm", bool, "kernels", None),
    ("moe_permute_fusion", bool, "kernels", None),
    ("moe_enable_deepep", bool, "kernels", None),
    ("no_masked_softmax_fusion", bool, "kernels", None),
    ("no_rope_fusion", bool, "kernels", None),
    ("no_bias_swiglu_fusion", bool, "kernels", None),
    ("no_gradient_accumulation_fusion", bool, "kernels", None),
    # precision
    ("accumulate_allreduce_grads_in_fp32", bool, "precision", None),
    ("attention_softmax_in_fp32", bool, "precision", None),
    # optimizer internals
    ("use_precision_aware_optimizer", bool, "optimizer", None),
    ("overlap_cpu_optimizer_d2h_h2d", bool, "optimizer", None),
    ("overlap_grad_reduce", bool, "optimizer", None),
    ("overlap_param_gather", bool, "optimizer", None),
    # dropout
    ("attention_dropout", float, "dropout", None),
    ("hidden_dropout", float, "dropout", None),
    # other Megatron training details
    ("ckpt_format", str, "other", None),
    ("no_load_optim", bool, "other", None),
    ("no_load_rng", bool, "other", None),
    ("no_save_optim", bool, "other", None),
    ("log_interval", int, "other", None),
)

CATEGORY_OF = {name: category for name, _, category, _ in MEGATRON_TABLE}


def _field(name: str, kind: Any, category: str, choices: tuple[Any, ...] | None) -> tuple[str, Any, Any]:
    help_text = f"Megatron-LM ({category}), accepted and not used: {CATEGORIES[category]}"
    if kind is bool:
        return name, bool, flag(False, help=help_text)
    metavar = "VALUE ..." if kind in (_T, tuple[float, ...]) else None
    # Megatron's sizes, rates and coefficients are never negative.
    return name, kind | None, flag(None, help=help_text, choices=choices, secret=False, metavar=metavar,
                                   minimum=0 if kind in (int, float, tuple[float, ...]) else None)


def _build() -> type[Slice]:
    cls = dataclasses.make_dataclass(
        "MegatronConfig",
        [_field(*row) for row in MEGATRON_TABLE],
        bases=(Slice,),
        frozen=True,
        namespace={
            "TITLE": "Megatron-LM",
            "DESCRIPTION": "Megatron-LM flags of slime/miles launch scripts: parsed, reported in one notice, not "
                           "used (docs/porting.md)",
            "__module__": __name__,
        },
    )
    return cls


MegatronConfig = _build()


def given_megatron_flags(config: Any) -> dict[str, Any]:
    """The Megatron flags this run was given, by field name, with their values (switches: True)."""
    return {name: getattr(config.megatron, name) for name in CATEGORY_OF if name in config.given}
