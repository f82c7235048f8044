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


@dataclass(frozen=True)
class TrainSettings:
    model_path: str
    lr: float = 1e-6
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    warmup_steps: int = 0
    eps_clip: float = 0.2
    # None: the same as eps_clip (symmetric clipping).
    eps_clip_high: float | None = None
    kl_coef: float = 0.0
    use_kl_loss: bool = False
    entropy_coef: float = 0.0
    # <= 0 disables clipping; the norm is still reported.
    clip_grad: float = 1.0
    max_tokens_per_micro_batch: int = 8192
    seed: int = 1234
    # Coordinator-side keys (how a rollout is cut into optimizer steps, where checkpoints go); accepted
    # here so one config dict serves both sides.
    global_batch_size: int | None = None
    num_steps_per_rollout: int | None = None
    save_dir: str | None = None
    # Parameter dtype: float32 keeps CPU logprobs within 1e-4 of a float32 engine.
    dtype: str = "float32"
    # Mixed-precision compute dtype under FSDP2 on CUDA (None: the parameter dtype).
    compute_dtype: str | None = None
    attn_implementation: str | None = None
    gradient_checkpointing: bool = False

    @property
    def clip_high(self) -> float:
        return self.eps_clip if self.eps_clip_high is None else self.eps_clip_high

    @property
    def needs_reference(self) -> bool:
        return self.use_kl_loss or self.kl_coef > 0

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
