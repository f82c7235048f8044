"""The training ranks' settings, built once from the run's config: `train_settings(config) -> TrainSettings`.

Owns the one mapping from the config's slices to what the ranks receive (`workers.protocol.train_settings`, the
init command's body): each component is one slice's projection, given what other slices decide as arguments
(the policy loss from `--advantage-estimator`, the loss type from SFT, one sample per micro-batch from
deterministic mode, the TIS hook's `args` from the hook layer); no component is built and then patched by
another slice. The ranks never see the coordinator's Config.
"""

from __future__ import annotations

from typing import Any

from coordinator.config.settings import Config
from workers.protocol.train_settings import (
    CheckpointSettings,
    MemorySettings,
    ModelSettings,
    ParallelSettings,
    TrainSettings,
)


def train_settings(config: Config, *, tis_hook_args: dict[str, Any] | None = None) -> TrainSettings:
    """What the ranks are initialised with. `tis_hook_args`: slime's `args` namespace as plain data, for a
    `--custom-tis-function-path` hook (`coordinator.hooks.args.tis_hook_args` builds it: the hook layer's)."""
    train, rollout = config.train, config.rollout
    hf_checkpoint = str(rollout.hf_checkpoint)
    return TrainSettings(
        model=train.model_settings(ModelSettings(path=hf_checkpoint, reference_path=config.reference_path(),
                                                 lora=config.lora.rank_lora(hf_checkpoint))),
        seed=train.seed,
        optimizer=train.optimizer_settings(config.total_train_steps),
        loss=train.loss_settings(policy_loss="gspo" if rollout.advantage_estimator == "gspo" else "ppo",
                                 loss_type=config.sft.loss_type if config.sft.enabled else "policy_loss",
                                 hook_args=tis_hook_args if train.custom_tis_function_path is not None else None),
        batching=train.batching_settings(one_sample_per_micro_batch=config.determinism.active),
        checkpoint=CheckpointSettings(save_dir=config.checkpoint.save,
                                      save_retain_interval=config.checkpoint.save_retain_interval),
        memory=_memory(config),
        parallel=ParallelSettings(train_pg_timeout_s=train.train_pg_timeout_s),
        determinism=config.determinism.settings(),
        opd=config.distill.rank_opd(config.distill.teacher_path()) if config.distill.use_opd else None,
        returns=config.critic.rank_returns(rollout.advantage_estimator,
                                           normalize=rollout.normalize_advantages),
        critic=config.critic.rank_critic(rollout.advantage_estimator, lr=train.lr,
                                         load_path=config.critic.critic_load),
    )


def _memory(config: Config) -> MemorySettings:
    if not config.offloads_train:
        return MemorySettings()
    # CPU ranks spill their state to a file here (a real disk, so the memory is freed, not moved)
    return MemorySettings(offload_dir=str(config.logging.resolved_run_dir / "train-offload"),
                          train_memory_margin_bytes=config.cluster.train_memory_margin_bytes)
