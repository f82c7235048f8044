"""The trainer's settings: one frozen config per trainer component, the body of the init command.

Owns `TrainSettings` and its parts (model, optimizer, loss, batching, checkpoint, memory, parallel, LoRA,
per-token returns, the critic). The
coordinator builds them once from its flags (`coordinator.config.training`); they travel as they are in
`InitCommand` and the rank decodes them into the same types (unknown keys refused, types checked by msgspec).

Invariant: a value no component can use is refused where the settings are built, in `__post_init__` (which
msgspec runs on decoding too), with a message naming the field, so the same rule holds on both ends of the
wire and is written once.
"""

from __future__ import annotations

from typing import Any

import msgspec

KL_LOSS_TYPES = ("k1", "k2", "k3", "low_var_kl")
LR_DECAY_STYLES = ("constant", "linear", "cosine")
POLICY_LOSSES = ("ppo", "gspo")
LOSS_TYPES = ("policy_loss", "sft_loss")
DTYPES = ("float32", "bfloat16", "float16")
DATA_PARALLEL = ("auto", "fsdp", "replicate")
OPD_TYPES = ("sglang", "megatron")


class SettingsError(ValueError):
    """A trainer setting holds a value the trainer cannot use."""


class _Settings(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Strict and frozen: an unknown key is refused on decoding, and nothing changes after the build."""


def _choose(name: str, value: object, choices: tuple[object, ...]) -> None:
    if value not in choices:
        raise SettingsError(f"{name} must be one of {', '.join(map(str, choices))}, got {value!r}")


def _at_least(name: str, value: float | None, floor: float) -> None:
    if value is not None and value < floor:
        raise SettingsError(f"{name} must be >= {floor}, got {value}")


class LoraSettings(_Settings):
    """peft's LoRA adapters on the policy (miles' --lora-* flags); the engines get merged weights."""

    rank: int
    alpha: float
    target_modules: tuple[str, ...]
    dropout: float = 0.0
    exclude_modules: tuple[str, ...] = ()
    adapter_path: str | None = None  # a pre-trained adapter (HF PEFT format): miles' --lora-adapter-path

    def __post_init__(self) -> None:
        _at_least("lora.rank", self.rank, 1)
        if not self.target_modules:
            raise SettingsError("lora needs at least one target module")
        if not 0 <= self.dropout < 1:
            raise SettingsError(f"lora.dropout must be in [0, 1), got {self.dropout}")

    def record(self) -> dict[str, Any]:
        """What a checkpoint records of the adapters: what must agree for a resume to load them."""
        return {"rank": self.rank, "alpha": self.alpha, "target_modules": sorted(self.target_modules),
                "exclude_modules": sorted(self.exclude_modules)}


class ModelSettings(_Settings):
    """The policy and its reference: where they load from and in which dtype."""

    path: str  # the --hf-checkpoint directory
    reference_path: str | None = None  # the KL's reference: an HF directory or a rayless checkpoint (None: path)
    dtype: str = "float32"
    compute_dtype: str | None = None  # FSDP2's mixed precision (--bf16 / --fp16); None: dtype
    attn_implementation: str | None = None
    gradient_checkpointing: bool = False
    lora: LoraSettings | None = None

    def __post_init__(self) -> None:
        _choose("model.dtype", self.dtype, DTYPES)
        _choose("model.compute_dtype", self.compute_dtype, (None, *DTYPES))


class OptimizerSettings(_Settings):
    """Adam and Megatron's schedule, in optimizer steps: warm-up from warmup_init_lr, then constant / linear /
    cosine decay to min_lr over lr_decay_steps (None: no decay span known, so constant)."""

    lr: float = 1e-6
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
    clip_grad: float = 1.0

    def __post_init__(self) -> None:
        _at_least("optimizer.lr", self.lr, 0)
        _at_least("optimizer.warmup_steps", self.warmup_steps, 0)
        _choose("optimizer.lr_decay_style", self.lr_decay_style, LR_DECAY_STYLES)
        if not (0 <= self.adam_beta1 < 1 and 0 <= self.adam_beta2 < 1):
            raise SettingsError(f"adam betas must be in [0, 1), got {self.adam_beta1}, {self.adam_beta2}")

    @property
    def warmup(self) -> float:
        """Warm-up steps: the fraction of the decay span when one is given, else warmup_steps."""
        if self.warmup_fraction is not None and self.lr_decay_steps:
            return self.warmup_fraction * self.lr_decay_steps
        return self.warmup_steps


class LossSettings(_Settings):
    """slime's policy loss: the clipped ratio, TIS, the KL to the reference and the entropy bonus; or, with
    `loss_type` "sft_loss", the NLL of the loss-mask tokens (`train_rank.sft_loss`: no old logprobs, reference or
    advantages)."""

    policy_loss: str = "ppo"  # per-token ratio; "gspo": the sequence's
    loss_type: str = "policy_loss"  # slime's --loss-type: policy_loss | sft_loss
    eps_clip: float = 0.2
    eps_clip_high: float | None = None  # None: eps_clip
    eps_clip_c: float | None = None  # dual-clip PPO's c (> 1): a negative advantage's loss capped at -c·A
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.0
    kl_loss_type: str = "k1"
    entropy_coef: float = 0.0
    use_rollout_logprobs: bool = False
    use_tis: bool = False
    tis_clip: float = 2.0
    tis_clip_low: float = 0.0
    tis_function_path: str | None = None  # slime's --custom-tis-function-path
    hook_args: dict[str, Any] | None = None  # slime's args namespace as plain data, for that hook

    def __post_init__(self) -> None:
        _at_least("loss.eps_clip", self.eps_clip, 0)
        _at_least("loss.eps_clip_high", self.eps_clip_high, 0)
        if self.eps_clip_c is not None and not self.eps_clip_c > 1.0:
            raise SettingsError(f"loss.eps_clip_c (--eps-clip-c) {self.eps_clip_c}: dual-clip PPO's lower bound "
                                "must be above 1 (slime's rule)")
        _choose("loss.kl_loss_type", self.kl_loss_type, KL_LOSS_TYPES)
        _choose("loss.policy_loss", self.policy_loss, POLICY_LOSSES)
        _choose("loss.loss_type", self.loss_type, LOSS_TYPES)
        if self.use_tis and self.use_rollout_logprobs:
            raise SettingsError("use_tis (--use-tis) weights the loss by train/rollout logprob ratios; "
                                "use_rollout_logprobs (--use-rollout-logprobs) takes the rollout logprobs as the "
                                "train ones: slime allows only one of them")
        if self.tis_clip_low > self.tis_clip:
            raise SettingsError(f"tis_clip_low (--tis-clip-low) {self.tis_clip_low} is above tis_clip "
                                f"(--tis-clip) {self.tis_clip}")

    @property
    def clip_high(self) -> float:
        return self.eps_clip if self.eps_clip_high is None else self.eps_clip_high

    @property
    def needs_reference(self) -> bool:
        # As slime: --use-kl-loss loads the reference even with a zero coefficient (the KL is still logged).
        return self.use_kl_loss

    @property
    def recomputes_old_log_probs(self) -> bool:
        return not self.use_rollout_logprobs and self.loss_type != "sft_loss"


class BatchingSettings(_Settings):
    """How a rollout's samples become optimizer steps and micro-batches."""

    max_tokens_per_micro_batch: int = 8192  # real tokens per packed micro-batch (--max-tokens-per-gpu)
    micro_batch_size: int | None = None  # samples per micro-batch instead (Megatron's, without dynamic batching)
    log_probs_chunk_size: int | None = None  # logprobs from the hidden states in chunks of this many positions (-1: whole)
    global_batch_size: int | None = None  # samples per optimizer step (None: one step per rollout)
    num_steps_per_rollout: int | None = None
    #: miles' --use-dynamic-global-batch-size: one step per rollout over its samples rounded down to a multiple of
    #: the data-parallel ranks, however many the rollout returned
    dynamic_global_batch_size: bool = False

    def __post_init__(self) -> None:
        _at_least("batching.max_tokens_per_micro_batch", self.max_tokens_per_micro_batch, 1)
        _at_least("batching.micro_batch_size", self.micro_batch_size, 1)
        _at_least("batching.global_batch_size", self.global_batch_size, 1)
        _at_least("batching.num_steps_per_rollout", self.num_steps_per_rollout, 1)
        if self.global_batch_size is not None and self.num_steps_per_rollout is not None:
            raise SettingsError("set either batching.global_batch_size or batching.num_steps_per_rollout, not both")


class CheckpointSettings(_Settings):
    save_dir: str | None = None  # --save
    save_retain_interval: int | None = None  # keep every Nth checkpoint, drop the rest (miles')


class MemorySettings(_Settings):
    """Where a CPU rank spills its state between steps (colocated runs), and what it keeps free."""

    offload_dir: str | None = None
    train_memory_margin_bytes: int = 0

    def __post_init__(self) -> None:
        _at_least("memory.train_memory_margin_bytes", self.train_memory_margin_bytes, 0)


class ParallelSettings(_Settings):
    data_parallel: str = "auto"  # FSDP2 on CUDA, gloo replicas on CPU; or forced
    # torchtitan's: the process group's timeout after the first step (the start-up's is longer)
    train_pg_timeout_s: float | None = 300.0

    def __post_init__(self) -> None:
        _choose("parallel.data_parallel", self.data_parallel, DATA_PARALLEL)
        _at_least("parallel.train_pg_timeout_s", self.train_pg_timeout_s, 0)


class DeterminismSettings(_Settings):
    """--deterministic-mode on the rank: the intra-op thread count every rank pins (`train_rank.determinism`)."""

    threads: int | None = None  # None: off

    def __post_init__(self) -> None:
        _at_least("determinism.threads", self.threads, 1)


class OpdSettings(_Settings):
    """On-policy distillation on the rank (`train_rank.distill`): where teacher logprobs come from and the term's
    weight. `sglang`: with the samples; `megatron`: from the frozen teacher at `teacher_path`."""

    type: str
    kl_coef: float = 1.0
    teacher_path: str | None = None
    #: miles' `--opd-log-prob-top-k`: > 0, each sample carries its per-token reverse KL (`opd_reverse_kl`)
    top_k: int = 0

    def __post_init__(self) -> None:
        _choose("opd.type", self.type, OPD_TYPES)
        if self.top_k < 0 or (self.top_k > 0 and self.type != "sglang"):
            raise SettingsError(f"opd.top_k {self.top_k}: top-k OPD is a non-negative k, only with opd.type 'sglang'")
        if self.type == "megatron" and not self.teacher_path:
            raise SettingsError("opd.type 'megatron' needs opd.teacher_path (the teacher model the rank loads)")


RETURN_ESTIMATORS = ("ppo", "reinforce_plus_plus")


class ReturnsSettings(_Settings):
    """Per-token advantages computed on the rank (`train_rank.returns`): slime's GAE for `ppo` (with the
    critic's values) and REINFORCE++'s discounted returns; the sample's `advantage` on the wire is then its
    scalar reward. `normalize`: slime's `--normalize-advantages`, whitened over the train command's loss tokens
    on every rank."""

    estimator: str
    gamma: float = 1.0
    lambd: float = 1.0
    normalize: bool = False

    def __post_init__(self) -> None:
        _choose("returns.estimator", self.estimator, RETURN_ESTIMATORS)
        for name, value in (("returns.gamma", self.gamma), ("returns.lambd", self.lambd)):
            if not 0 <= value <= 1:
                raise SettingsError(f"{name} must be in [0, 1], got {value}")


class CriticSettings(_Settings):
    """PPO's value model (`train_rank.critic`): the policy's architecture with a fresh 1-output head, or the
    critic of a rayless checkpoint (`load_path`); its own Adam at `lr` (warm-up over `warmup_steps`), slime's
    clipped value loss (`value_clip`), and the first `critic_only_steps` rollouts training it alone."""

    lr: float
    warmup_steps: int = 0
    value_clip: float = 0.2
    critic_only_steps: int = 0
    load_path: str | None = None

    def __post_init__(self) -> None:
        _at_least("critic.lr", self.lr, 0)
        _at_least("critic.warmup_steps", self.warmup_steps, 0)
        _at_least("critic.value_clip", self.value_clip, 0)
        _at_least("critic.critic_only_steps", self.critic_only_steps, 0)


class TrainSettings(_Settings):
    """Everything a training rank is told, by component."""

    model: ModelSettings
    optimizer: OptimizerSettings = msgspec.field(default_factory=OptimizerSettings)
    loss: LossSettings = msgspec.field(default_factory=LossSettings)
    batching: BatchingSettings = msgspec.field(default_factory=BatchingSettings)
    checkpoint: CheckpointSettings = msgspec.field(default_factory=CheckpointSettings)
    memory: MemorySettings = msgspec.field(default_factory=MemorySettings)
    parallel: ParallelSettings = msgspec.field(default_factory=ParallelSettings)
    determinism: DeterminismSettings = msgspec.field(default_factory=DeterminismSettings)
    opd: OpdSettings | None = None  # None: no on-policy distillation
    returns: ReturnsSettings | None = None  # None: the sample's advantage is every token's
    critic: CriticSettings | None = None  # None: no value model (every estimator but ppo)
    seed: int = 1234

    def __post_init__(self) -> None:
        if (self.critic is not None) != (self.returns is not None and self.returns.estimator == "ppo"):
            raise SettingsError("a critic is trained exactly when returns.estimator is 'ppo'")

    def replace(self, **changes: Any) -> TrainSettings:
        """A copy with whole components replaced (`settings.replace(loss=...)`), validated again."""
        return msgspec.structs.replace(self, **changes)
