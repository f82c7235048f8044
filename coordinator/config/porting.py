"""What a slime or miles launch script means here: the one grouped notice that says which of its flags are mapped,
ignored (and why), or disagree with the model, and which built-in hook paths became ours.

Owns `porting_notice`: the notice text, one line per kind of fact, or None when the run used none of this. The
hook aliases are `hook_aliases`'; what `--load` / `--ref-load` hold on disk is `checkpoint.resolve_load` /
`resolve_ref_load`'s.

Invariant: every failure is a ConfigError naming the flag; reading `config.json` is the only I/O here.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from coordinator.config.fields import ConfigWarning, flag_name
from coordinator.config.megatron import CATEGORIES, CATEGORY_OF
from workers.boundary.json_input import decode_json

if TYPE_CHECKING:
    from coordinator.config.checkpoint import LoadPlan
    from coordinator.config.settings import Config


class PortingNotice(ConfigWarning):
    """The grouped notice about flags from slime/miles launch scripts (printed once, before the run)."""


# ---------------------------------------------------------------------------------------------------------
# The notice
# ---------------------------------------------------------------------------------------------------------
#: Megatron flag → config.json keys holding the same fact (first present wins).
_SAME_FACT: dict[str, tuple[str, ...]] = {
    "num_layers": ("num_hidden_layers",),
    "hidden_size": ("hidden_size",),
    "ffn_hidden_size": ("intermediate_size",),
    "num_attention_heads": ("num_attention_heads",),
    "num_query_groups": ("num_key_value_heads",),
    "kv_channels": ("head_dim",),
    "vocab_size": ("vocab_size",),
    "max_position_embeddings": ("max_position_embeddings",),
    "norm_epsilon": ("rms_norm_eps", "layer_norm_epsilon", "layer_norm_eps"),
    "rotary_base": ("rope_theta",),
    "num_experts": ("num_experts", "n_routed_experts", "num_local_experts"),
    "moe_ffn_hidden_size": ("moe_intermediate_size",),
    "moe_router_topk": ("num_experts_per_tok",),
    "q_lora_rank": ("q_lora_rank",),
    "kv_lora_rank": ("kv_lora_rank",),
    "qk_head_dim": ("qk_nope_head_dim",),
    "qk_pos_emb_head_dim": ("qk_rope_head_dim",),
    "v_head_dim": ("v_head_dim",),
    "attention_dropout": ("attention_dropout",),
    "hidden_dropout": ("hidden_dropout",),
}


def model_context_length(config: Config) -> tuple[int | None, str]:
    """The engines' context length and where it comes from: `--sglang-context-length`, else the model's
    `max_position_embeddings` (as `coordinator.services` gives the engines and the rollout), else None."""
    if config.sglang.sglang_context_length:
        return config.sglang.sglang_context_length, f"--sglang-context-length {config.sglang.sglang_context_length}"
    context = _model_config(config).get("max_position_embeddings")
    if isinstance(context, int) and not isinstance(context, bool) and context > 0:
        return context, f"max_position_embeddings in {Path(config.rollout.hf_checkpoint or '') / 'config.json'}"
    return None, ""


def _model_config(config: Config) -> dict[str, Any]:
    path = Path(config.rollout.hf_checkpoint or "") / "config.json"
    try:
        data = decode_json(path.read_bytes(), str(path))  # BoundaryError is a ValueError
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict):
        return {}
    text = data.get("text_config")
    merged = {**data, **text} if isinstance(text, dict) else dict(data)
    rope = merged.get("rope_parameters")
    if "rope_theta" not in merged and isinstance(rope, dict) and "rope_theta" in rope:
        merged["rope_theta"] = rope["rope_theta"]
    return merged


def model_experts(config: Config) -> int | None:
    """The routed experts --hf-checkpoint's config.json declares (0: a dense model), None when unreadable."""
    model = _model_config(config)
    if not model:
        return None
    counts = [model.get(key) for key in _SAME_FACT["num_experts"]]
    return max((count for count in counts if isinstance(count, int) and not isinstance(count, bool)), default=0)


def _differs(ours: Any, theirs: Any) -> bool:
    if isinstance(theirs, bool) or not isinstance(theirs, int | float):
        return False
    return not math.isclose(float(ours), float(theirs), rel_tol=1e-9, abs_tol=0.0)


def _number(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def architecture_disagreements(config: Config, given: dict[str, Any]) -> list[str]:
    """`--flag VALUE ≠ key VALUE` for each given Megatron flag that states a fact config.json states otherwise
    (and the untied/tied embeddings switch)."""
    model = _model_config(config)
    found = []
    for name, keys in _SAME_FACT.items():
        if name not in given:
            continue
        key = next((key for key in keys if key in model), None)
        if key is not None and _differs(given[name], model[key]):
            found.append(f"{flag_name(name)} {_number(given[name])} ≠ {key} {_number(model[key])}")
    tied = model.get("tie_word_embeddings")
    if given.get("untie_embeddings_and_output_weights") and tied is True:
        found.append("--untie-embeddings-and-output-weights ≠ tie_word_embeddings true")
    seq_length = given.get("seq_length")
    context = config.sglang.sglang_context_length or model.get("max_position_embeddings")
    if isinstance(seq_length, int) and isinstance(context, int) and seq_length > context:
        found.append(f"--seq-length {seq_length} > the context length {context}")
    return found


def _mapped(config: Config) -> list[str]:
    train, given = config.train, config.given
    mapped = []
    if train.bf16 or train.fp16:
        dtype = train.compute_dtype
        mapped.append(f"--{'bf16' if train.bf16 else 'fp16'} → compute dtype {dtype} (FSDP2 mixed precision on "
                      "GPU; float32 on CPU)")
    recompute = [flag_name(n) for n in ("recompute_granularity", "recompute_method", "recompute_num_layers")
                 if n in given]
    if recompute:
        mapped.append(f"{' '.join(recompute)} → activation checkpointing of every decoder layer")
    if train.use_dynamic_batch_size:
        extra = " (--micro-batch-size ignored, as slime)" if "micro_batch_size" in given else ""
        mapped.append(f"--use-dynamic-batch-size → micro-batches of ≤ {train.max_tokens_per_gpu} tokens{extra}")
    elif "micro_batch_size" in given:
        mapped.append(f"--micro-batch-size → {train.micro_batch_size} samples per micro-batch")
    mapped += [row.note for row in _given_mapped_rows(config)]
    if config.renamed_flags:
        from coordinator.config.upstream import upstream_rows

        rows = upstream_rows()
        mapped += [rows[old].note for old, _ in config.renamed_flags]  # every RENAMED flag has its row
    if config.train.megatron_config_path is not None:
        from coordinator.config.megatron_roles import describe

        mapped.append(describe(config) or "")
    if train.optimizer_cpu_offload:
        mapped.append("--optimizer-cpu-offload: not implemented yet, the optimizer state stays on the device")
    if config.sglang.update_weight_transfer_mode == "p2p":
        mapped.append("--update-weight-transfer-mode p2p → distributed (miles' RDMA from each rank; here rank 0 "
                      "broadcasts the same weights to the engines' process group)")
    if train.balance_data:
        mapped.append("--balance-data: always on (tokens balanced across ranks)")
    if config.debug.dump_details is not None:
        mapped.append(f"--dump-details → rollouts dumped to {config.debug.save_debug_rollout_data} (rayless' dump "
                      "format; miles' per-rank train_data tensors are not written)")
    return mapped


def _given_mapped_rows(config: Config) -> list[Any]:
    """The given flags whose `upstream_flags.tsv` row is `mapped` with a note that is its notice line (rows
    whose notice depends on values are written in `_mapped` itself)."""
    from coordinator.config.upstream import upstream_rows

    rows = upstream_rows()
    found = []
    for name in config.given:
        row = rows.get(flag_name(name))
        if row is None or row.disposition != "mapped":
            continue
        if name == "train_backend" and config.train.train_backend != "megatron":
            continue  # --train-backend fsdp is what rayless is: nothing to say
        found.append(row)
    return found


def _rl_facts(config: Config) -> list[str]:
    facts = []
    if config.eval.eval_config is not None:
        from coordinator.config.eval_file import delegate_names

        names = delegate_names(config.eval.eval_config)
        runner = config.rollout.eval_function_path or "an --eval-function-path that runs them (miles' delegate eval)"
        if names:
            facts.append(f"--eval-config delegate {', '.join(names)}: run by {runner}, which reads the file "
                         "itself; rayless' own eval runs the file's datasets")
    estimator = config.rollout.advantage_estimator
    if config.train.kl_coef and estimator in ("grpo", "gspo"):
        facts.append(f"--kl-coef {config.train.kl_coef:g} has no effect on {estimator} advantages (as slime)")
    if "sglang_router_policy" in config.given and not config.sglang.launches_router \
            and config.sglang.sglang_router_ip is None:
        facts.append(f"--sglang-router-policy {config.sglang.sglang_router_policy}: no sglang-router is launched, "
                     "so no policy applies (rayless dispatches each request to the engine with the fewest in flight)")
    if config.checkpoint.ref_load is not None and not config.train.use_kl_loss:
        facts.append("--ref-load is not used without --use-kl-loss")
    return facts


def porting_notice(config: Config, *, load: LoadPlan | None = None) -> str | None:
    """The grouped notice, a few lines, or None when nothing of a slime/miles script needs saying."""
    from coordinator.config.megatron import given_megatron_flags

    given = given_megatron_flags(config)
    lines = []
    mapped = _mapped(config)
    if mapped:
        lines.append("mapped: " + "; ".join(mapped))
    for flag, theirs, ours in config.hook_aliases:
        lines.append(f"{flag} {theirs} → {ours}")
    if load is not None and load.fresh_reason is not None:
        lines.append(f"--load {config.checkpoint.load} {load.fresh_reason}: training starts fresh from "
                     "--hf-checkpoint (as slime)")
    lines += _rl_facts(config)
    if given or config.upstream_ignored:
        by_category: dict[str, list[str]] = {}
        for name in given:
            by_category.setdefault(CATEGORY_OF[name], []).append(flag_name(name))
        for row in config.upstream_ignored:
            by_category.setdefault(row.category, []).append(row.flag)
        disagreements = architecture_disagreements(config, given)
        count = len(given) + len(config.upstream_ignored)
        lines.append(f"Megatron-LM flags ignored ({count}, with slime/miles flags that have no meaning under FSDP2), by why:")
        for category, flags in by_category.items():
            lines.append(f"  {CATEGORIES[category]}: {' '.join(flags)}")
        for row in config.upstream_ignored:
            detail = row.note.partition(":")[2].strip()
            if detail:
                lines.append(f"  {row.flag}: {detail}")
        if disagreements:
            lines.append(f"  they disagree with {config.rollout.hf_checkpoint}/config.json, which is used: "
                         + ", ".join(disagreements))
    if not lines:
        return None
    return "flags from a slime/miles launch script (docs/porting.md):\n  " + "\n  ".join(lines)
