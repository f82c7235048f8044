"""The train slice: what the training ranks are told (optimizer, loss, batching, seed).

Owns these flags and `rank_settings`, the one mapping from them to the settings dict the ranks validate
(`workers.train_rank.settings.TrainSettings`): the ranks never see the coordinator's Config.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from coordinator.config.fields import Slice, flag


@dataclass(frozen=True)
class TrainConfig(Slice):
    TITLE = "training"
    DESCRIPTION = "optimizer, loss and batching on the training ranks"

    seed: int = flag(1234, help="training seed", minimum=0)
    lr: float = flag(1e-6, help="learning rate", minimum=0)
    lr_warmup_iters: int = flag(0, help="linear warm-up steps", minimum=0)
    weight_decay: float = flag(0.0, help="AdamW weight decay", minimum=0)
    clip_grad: float = flag(1.0, help="gradient norm clip (0 = no clipping; the norm is still reported)", minimum=0)
    eps_clip: float = flag(0.2, help="PPO ratio clip (low)", minimum=0)
    eps_clip_high: float | None = flag(None, help="PPO ratio clip (high; default: --eps-clip)", minimum=0)
    kl_coef: float = flag(0.0, help="KL penalty coefficient to the reference model", minimum=0)
    use_kl_loss: bool = flag(False, help="add the KL to the reference as a loss term")
    entropy_coef: float = flag(0.0, help="entropy bonus coefficient", minimum=0)
    max_tokens_per_gpu: int = flag(8192, help="token budget of one micro-batch", minimum=1)
    global_batch_size: int | None = flag(None, help="samples per optimizer step (default: the whole rollout)",
                                         minimum=1)

    def rank_settings(self, *, model_path: str, save_dir: str | None) -> dict[str, Any]:
        """What the ranks need to know, and nothing else."""
        return {
            "model_path": model_path,
            "seed": self.seed,
            "lr": self.lr,
            "warmup_steps": self.lr_warmup_iters,
            "weight_decay": self.weight_decay,
            "clip_grad": self.clip_grad,
            "eps_clip": self.eps_clip,
            "eps_clip_high": self.eps_clip_high if self.eps_clip_high is not None else self.eps_clip,
            "kl_coef": self.kl_coef,
            "use_kl_loss": self.use_kl_loss,
            "entropy_coef": self.entropy_coef,
            "max_tokens_per_micro_batch": self.max_tokens_per_gpu,
            "global_batch_size": self.global_batch_size,  # None: one optimizer step per rollout
            "save_dir": save_dir,
        }
