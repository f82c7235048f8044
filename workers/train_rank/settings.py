"""The rank's training settings, built once from the coordinator's `init` config and validated there.

Invariant: an unknown key or a contradictory value is rejected at `init` with a message naming the key,
so a typo never silently falls back to a default.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any


class SettingsError(ValueError):
    """The init config names an unknown key or holds a value the trainer cannot use."""


KL_LOSS_TYPES = ("k1", "k2", "k3", "low_var_kl")
LR_DECAY_STYLES = ("constant", "linear", "cosine")
POLICY_LOSSES = ("ppo", "gspo")


@dataclass(frozen=True)
class TrainSettings:
    model_path: str
    # The reference model of the KL: a Hugging Face directory or a rayless checkpoint (None: model_path).
    reference_path: str | None = None
    lr: float = 1e-6
    # Megatron's schedule, in optimizer steps: warm-up from warmup_init_lr, then constant / linear / cosine
    # decay to min_lr over lr_decay_steps (None: no decay span known, so constant).
    min_lr: float = 0.0
    lr_decay_style: str = "constant"
    lr_decay_steps: int | None = None
    warmup_steps: int = 0
    warmup_fraction: float | None = None
    warmup_init_lr: float = 0.0
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    eps_clip: float = 0.2
    # None: the same as eps_clip (symmetric clipping).
    eps_clip_high: float | None = None
    # "ppo": per-token ratio; "gspo": the sequence's mean log-ratio, broadcast to its tokens.
    policy_loss: str = "ppo"
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.0
    kl_loss_type: str = "k1"
    entropy_coef: float = 0.0
    # False (slime's default): the PPO ratio is taken against logprobs the trainer recomputes before the
    # rollout's first step; True: against the engine's logprobs.
    use_rollout_logprobs: bool = False
    use_tis: bool = False
    tis_clip: float = 2.0
    tis_clip_low: float = 0.0
    # slime's TIS hook (`--custom-tis-function-path`, with use_tis) and the hooks' args it gets (plain values).
    tis_function_path: str | None = None
    hook_args: dict[str, Any] | None = None
    # <= 0 disables clipping; the norm is still reported.
    clip_grad: float = 1.0
    max_tokens_per_micro_batch: int = 8192
    # Positions whose logits are computed at once (`--log-probs-chunk-size`): None = chunks of at most 256 MiB of
    # float32 logits; <= 0 = the whole micro-batch at once (slime's -1); > 0 = that many positions.
    log_probs_chunk_size: int | None = None
    # "auto": FSDP2 on CUDA, replicas on CPU; "fsdp": FSDP2 on CPU (gloo) too; "replicate": never sharded.
    data_parallel: str = "auto"
    # The process group's timeout once the first step is done (the start-up's, model load included, is the
    # environment's RAYLESS_PG_TIMEOUT_S); None or 0 keeps the start-up's.
    train_pg_timeout_s: float | None = 300.0
    # Samples per micro-batch (None: pack by max_tokens_per_micro_batch).
    micro_batch_size: int | None = None
    seed: int = 1234
    # Coordinator-side keys (how a rollout is cut into optimizer steps, where checkpoints go); accepted
    # here so one config dict serves both sides.
    global_batch_size: int | None = None
    num_steps_per_rollout: int | None = None
    save_dir: str | None = None
    # When a checkpoint is saved, the previous one is deleted unless its rollout id is a multiple of this.
    save_retain_interval: int | None = None
    # Parameter dtype: float32 keeps CPU logprobs within 1e-4 of a float32 engine.
    dtype: str = "float32"
    # Mixed-precision compute dtype under FSDP2 on CUDA (None: the parameter dtype).
    compute_dtype: str | None = None
    attn_implementation: str | None = None
    gradient_checkpointing: bool = False
    # Colocation (`offload` / `onload` commands): where CPU ranks spill their state (None: the temp dir), and
    # the device memory that must stay free beyond the state when CUDA ranks bring it back.
    offload_dir: str | None = None
    train_memory_margin_bytes: int = 0
    # LoRA adapters instead of the full model (`lora.LoraSpec` as a dict; None: full fine-tuning).
    lora: dict[str, Any] | None = None
    # On-policy distillation (`distill.OpdSpec` as a dict; None: off).
    opd: dict[str, Any] | None = None

    @property
    def clip_high(self) -> float:
        return self.eps_clip if self.eps_clip_high is None else self.eps_clip_high

    @property
    def needs_reference(self) -> bool:
        # As slime: --use-kl-loss loads the reference even with a zero coefficient (the KL is still logged).
        return self.use_kl_loss

    @property
    def recomputes_old_log_probs(self) -> bool:
        return not self.use_rollout_logprobs

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> TrainSettings:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(config) - names)
        if unknown:
            raise SettingsError(f"unknown train config keys {unknown}; known keys: {sorted(names)}")
        if "model_path" not in config:
            raise SettingsError("train config needs 'model_path' (the --hf-checkpoint directory)")
        settings = cls(**config)
        settings.validate()
        return settings

    def validate(self) -> None:
        if self.lr < 0:
            raise SettingsError(f"lr must be >= 0, got {self.lr}")
        if self.eps_clip < 0 or self.clip_high < 0:
            raise SettingsError(
                f"eps_clip / eps_clip_high must be >= 0, got {self.eps_clip} / {self.clip_high}"
            )
        if self.warmup_steps < 0:
            raise SettingsError(f"warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.max_tokens_per_micro_batch <= 0:
            raise SettingsError(
                f"max_tokens_per_micro_batch must be > 0, got {self.max_tokens_per_micro_batch}"
            )
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise SettingsError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        if self.compute_dtype not in (None, "float32", "bfloat16", "float16"):
            raise SettingsError(f"compute_dtype must be float32, bfloat16 or float16, got {self.compute_dtype!r}")
        for name, value, choices in (("kl_loss_type", self.kl_loss_type, KL_LOSS_TYPES),
                                     ("lr_decay_style", self.lr_decay_style, LR_DECAY_STYLES),
                                     ("policy_loss", self.policy_loss, POLICY_LOSSES)):
            if value not in choices:
                raise SettingsError(f"{name} must be one of {', '.join(choices)}, got {value!r}")
        if not (0 <= self.adam_beta1 < 1 and 0 <= self.adam_beta2 < 1):
            raise SettingsError(f"adam betas must be in [0, 1), got {self.adam_beta1}, {self.adam_beta2}")
        if self.data_parallel not in ("auto", "fsdp", "replicate"):
            raise SettingsError(f"data_parallel must be auto, fsdp or replicate, got {self.data_parallel!r}")
        if self.train_pg_timeout_s is not None and self.train_pg_timeout_s < 0:
            raise SettingsError(f"train_pg_timeout_s must be >= 0, got {self.train_pg_timeout_s}")
        if self.micro_batch_size is not None and self.micro_batch_size < 1:
            raise SettingsError(f"micro_batch_size must be >= 1, got {self.micro_batch_size}")
        if self.train_memory_margin_bytes < 0:
            raise SettingsError(f"train_memory_margin_bytes must be >= 0, got {self.train_memory_margin_bytes}")
        if self.lora is not None:
            from workers.train_rank.lora import LoraError, LoraSpec

            try:
                LoraSpec.from_dict(self.lora)
            except (LoraError, KeyError, TypeError) as exc:
                raise SettingsError(f"lora: {exc}") from exc
        if self.opd is not None:
            from workers.train_rank.distill import DistillError, OpdSpec

            try:
                OpdSpec.from_dict(self.opd)
            except (DistillError, TypeError, ValueError) as exc:
                raise SettingsError(f"opd: {exc}") from exc
        if self.use_tis and self.use_rollout_logprobs:
            raise SettingsError("use_tis needs recomputed logprobs; it contradicts use_rollout_logprobs")
