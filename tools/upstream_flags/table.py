"""The first disposition of a flag new to the table (a person reviews it in the diff).

Owns `default_disposition`: a flag rayless already has is `implemented` (its Megatron slice: `ignored` with its
category); an SGLang server flag is passed through; a Megatron-LM-only flag is `ignored` in the category its
name says; anything else is `review`. The format itself is `coordinator.config.upstream`'s.
"""

from __future__ import annotations

import re

from coordinator.config.upstream import DATA_FILE, Row, read_rows, render

__all__ = ["DATA_FILE", "Row", "default_disposition", "megatron_category", "read_rows", "render"]

_CATEGORY_PATTERNS = (
    ("precision", r"fp8|fp4|fp16|bf16|fp32|mxfp|nvfp|precision|loss-scale|hysteresis|quant|amax|-dtype"),
    ("kernels", r"fusion|fused|kernel|flash|cuda-graph|cudagraph|transformer-impl|apex|triton|deepep|hybridep"
                r"|grouped-gemm|permute|persist|cudnn|nvte|jit|compile|te-|-te|attention-backend|tp-comm"),
    ("parallelism", r"parallel|pipeline|tensor-model|expert-model|sequence|distributed|overlap|nccl|gloo|"
                    r"data-parallel|virtual|hierarchical|fsdp|cp-|all-?gather|reduce-scatter|bucket|grad-reduce|"
                    r"param-gather|world-size|rank|dp-|tp-|ep-|pp-|-comm|sharding|decoder-first|decoder-last|"
                    r"microbatch-group|defer-embedding|align-"),
    ("moe", r"moe|expert|router"),
    ("memory", r"recompute|checkpoint-activations|offload|memory|empty-unused"),
    ("logging", r"log|tensorboard|wandb|timing|timer|profile|straggler|one-logger|energy|nvtx|monitor|"
                r"record|dump|print|verbose|throughput|inspector|heartbeat"),
    ("checkpoint", r"save|load|ckpt|checkpoint|async|exit|pretrained"),
    ("data", r"data|split|dataloader|num-workers|mock|tokenizer|vocab|eod|reset-|eval-iters|seq-length|"
             r"sample|shuffle|blend|cache|fim|mask"),
    ("architecture", r"layer|hidden|head|attention|norm|rotary|rope|embedding|swiglu|bias|mtp|mla|lora-rank|"
                     r"init|kv-|qk-|gated|window|activation|glu|mamba|hybrid|heterogeneous|yarn|softmax"),
)


def megatron_category(flag: str) -> str:
    for category, pattern in _CATEGORY_PATTERNS:
        if re.search(pattern, flag[2:]):
            return category
    return "other"


def default_disposition(flag: str, origins: dict[str, str]) -> tuple[str, str]:
    from coordinator.config.megatron import CATEGORY_OF
    from coordinator.config.parser import known_flags

    field = flag[2:].replace("-", "_")
    if flag in known_flags():
        return ("ignored", CATEGORY_OF[field]) if field in CATEGORY_OF else ("implemented", "")
    if set(origins) == {"sglang"}:
        return "implemented", "passed to sglang.launch_server without the prefix"
    if set(origins) == {"sglang-router"}:
        return "implemented", "passed to sglang-router without the prefix"
    if set(origins) == {"megatron"}:
        return "ignored", megatron_category(flag)
    return "review", ""
