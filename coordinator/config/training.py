"""The train slice: what the training ranks are told (optimizer, schedule, loss, batching, memory, seed).

Owns these flags and their projections onto the ranks' settings (`model_settings`, `optimizer_settings`,
`loss_settings`, `batching_settings`: components of `workers.protocol.train_settings.TrainSettings`, which hold
the rules that span fields, such as --use-tis against --use-rollout-logprobs); `coordinator.train.settings`
assembles them, with what other slices decide passed in as arguments, never patched in afterwards. Flag names and
meanings are slime's (Megatron's for the optimizer and schedule); docs/porting.md
lists where a default differs. Megatron flags with an equivalent here (`--micro-batch-size`,
`--use-dynamic-batch-size`, `--bf16`/`--fp16`, `--recompute-*`, `--optimizer-cpu-offload`) are declared here
too; the ones without one are in the `megatron` slice.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from coordinator.config import values
from coordinator.config.fields import ConfigError, Slice, flag
from workers.protocol.train_settings import (
    KL_LOSS_TYPES,
    LR_DECAY_STYLES,
    BatchingSettings,
    LossSettings,
    ModelSettings,
    OptimizerSettings,
    SettingsError,
)


@dataclass(frozen=True)
class TrainConfig(Slice):
    TITLE = "training"
    DESCRIPTION = "optimizer, schedule, loss and batching on the training ranks"

    seed: int = flag(1234, help="training seed", minimum=0)
    # --- optimizer (Megatron's flags; torch AdamW = Megatron's adam with decoupled weight decay)
    optimizer: str = flag("adam", help="optimizer: adam (torch AdamW, decoupled weight decay)", choices=("adam",))
    lr: float = flag(1e-6, help="peak learning rate", minimum=0)
    min_lr: float = flag(0.0, help="learning rate at the end of the decay", minimum=0)
    lr_decay_style: str = flag("constant", help="learning-rate decay after warm-up (Megatron's formulas)",
                               choices=LR_DECAY_STYLES)
    lr_decay_iters: int | None = flag(None, help="optimizer steps the decay spans (default: every step of the "
                                      "run, --num-rollout × steps per rollout)", minimum=1)
    lr_warmup_iters: int = flag(0, help="linear warm-up steps from --lr-warmup-init", minimum=0)
    lr_warmup_fraction: float | None = flag(None, help="warm-up as a fraction of the decay steps (instead of "
                                            "--lr-warmup-iters)", minimum=0, maximum=1)
    lr_warmup_init: float = flag(0.0, help="learning rate at the start of warm-up", minimum=0)
    weight_decay: float = flag(0.0, help="AdamW weight decay", minimum=0)
    adam_beta1: float = flag(0.9, help="Adam beta1", minimum=0, maximum=1)
    adam_beta2: float = flag(0.999, help="Adam beta2", minimum=0, maximum=1)
    adam_eps: float = flag(1e-8, help="Adam epsilon", above=0)
    clip_grad: float = flag(1.0, help="gradient norm clip (0 = no clipping; the norm is still reported)", minimum=0)
    optimizer_cpu_offload: bool = flag(False, help="Megatron's CPU optimizer: accepted; the optimizer state stays "
                                       "on the training device (not implemented yet)")
    # --- policy loss
    eps_clip: float = flag(0.2, help="PPO ratio clip: lower bound 1 - eps", minimum=0)
    eps_clip_high: float | None = flag(None, help="PPO ratio clip: upper bound 1 + eps (default: --eps-clip)",
                                       minimum=0)
    eps_clip_c: float | None = flag(None, help="dual-clip PPO (slime's): a token with a negative advantage A "
                                    "loses at most -c·A however large its ratio; c > 1 (default: off)", above=1)
    use_kl_loss: bool = flag(False, help="load the reference model and add --kl-loss-coef × KL to the loss")
    kl_loss_coef: float = flag(0.0, help="coefficient of the KL loss term (with --use-kl-loss)", minimum=0)
    kl_loss_type: str = flag("k1", help="KL estimator: k1 = log r, k2 = (log r)²/2, k3 = exp(-log r) - 1 + log r, "
                             "low_var_kl = k3 clamped to [-10, 10] (r = policy / reference)", choices=KL_LOSS_TYPES)
    kl_coef: float = flag(0.0, help="reward-shaping KL coefficient, as slime: no effect on grpo/gspo "
                          "advantages", minimum=0)
    entropy_coef: float = flag(0.0, help="entropy bonus coefficient", minimum=0)
    use_rollout_logprobs: bool = flag(False, help="PPO ratio against the engine's logprobs instead of logprobs "
                                      "recomputed by the trainer before the rollout's first step")
    skip_actor_forward_only: bool = flag(False, help="miles': no separate old-logprob pass. rayless runs none for "
                                         "a rollout's first optimizer step anyway (its own forward, detached: a "
                                         "log-ratio of exactly 0); with one step per rollout, as miles requires, "
                                         "that is every step")
    use_tis: bool = flag(False, help="truncated importance sampling: weight each token's loss by "
                         "clamp(exp(train logprob - rollout logprob), --tis-clip-low, --tis-clip)")
    tis_clip: float = flag(2.0, help="upper clamp of the TIS weight", minimum=0)
    tis_clip_low: float = flag(0.0, help="lower clamp of the TIS weight", minimum=0)
    custom_tis_function_path: str | None = flag(
        None, help="slime's TIS hook, run on the training ranks in place of the built-in weight (with --use-tis): "
        "fn(args, *, pg_loss, train_log_probs, rollout_log_probs, loss_masks, total_lengths, response_lengths) "
        "-> (pg_loss, loss_masks, metrics)", parse=values.hook_path, metavar="MODULE:NAME")
    # --- batching and memory
    global_batch_size: int | None = flag(None, help="samples per optimizer step (default: the whole rollout); "
                                         "any number: split over the training ranks by tokens, ranks beyond it "
                                         "idle in the step",
                                         minimum=1)
    num_steps_per_rollout: int | None = flag(None, help="optimizer steps per rollout (sets --global-batch-size "
                                             "to the rollout's samples / this)", minimum=1)
    use_dynamic_global_batch_size: bool = flag(False, help="one optimizer step per rollout over however many "
                                               "samples it returned, rounded down to a multiple of the training "
                                               "ranks (miles' flag; --global-batch-size is then not used)")
    balance_data: bool = flag(False, help="balance tokens across training ranks (always done here)")
    use_dynamic_batch_size: bool = flag(False, help="micro-batches packed up to --max-tokens-per-gpu tokens "
                                        "(the default here; --micro-batch-size is then ignored, as slime)")
    max_tokens_per_gpu: int = flag(8192, help="real tokens of one packed micro-batch (whole samples back to back "
                                   "in one row, first-fit-decreasing; a longer sample goes alone)", minimum=1)
    log_probs_chunk_size: int | None = flag(None, help="positions whose logits are computed at once for the "
                                            "logprobs and entropy (default: as many as fit 256 MiB of float32 "
                                            "logits; -1: the whole micro-batch at once, slime's default)",
                                            minimum=-1)
    attn_implementation: str | None = flag(None, help="the training model's attention (transformers' "
                                           "attn_implementation; default sdpa): flash_attention_2 runs packed "
                                           "micro-batches as varlen on CUDA, sdpa/eager with a block-diagonal mask",
                                           choices=("eager", "sdpa", "flash_attention_2", "flash_attention_3",
                                                    "flex_attention", "triton"))
    train_pg_timeout_s: float = flag(300.0, help="the training ranks' collective timeout after their first step "
                                     "(0: keep the start-up's, RAYLESS_PG_TIMEOUT_S or 600 s)", minimum=0)
    micro_batch_size: int | None = flag(None, help="samples per micro-batch (without --use-dynamic-batch-size; "
                                        "default: packing by --max-tokens-per-gpu)", minimum=1)
    bf16: bool = flag(False, help="compute in bfloat16 (FSDP2 mixed precision on GPU; parameters and gradient "
                      "reduction stay float32)")
    fp16: bool = flag(False, help="compute in float16 (as --bf16)")
    gradient_checkpointing: bool = flag(False, help="activation checkpointing of every decoder layer")
    use_rollout_routing_replay: bool = flag(False, help="slime's MoE routing replay (R3): refused for an MoE model "
                                            "(rayless' engines return no routed experts); a no-op, said in the "
                                            "notice, for a model without MoE layers")
    use_routing_replay: bool = flag(False, help="slime's MoE routing replay on the trainer: as "
                                    "--use-rollout-routing-replay")
    megatron_config_path: str | None = flag(None, help="slime's per-role YAML (megatron: [{role: actor, overrides: "
                                            "{lr: ...}}, {role: critic, ...}]): the keys that are flags here set "
                                            "them over the command line (docs/porting.md)", metavar="FILE")
    train_backend: str = flag("fsdp", help="slime/miles' trainer: rayless is an FSDP2 trainer; megatron is mapped to "
                              "it with a notice (the Megatron-LM flags are then ignored as listed)",
                              choices=("fsdp", "megatron"))
    calculate_per_token_loss: bool = flag(False, help="slime's per-token loss: always on here (each term is the token "
                                          "mean over the global batch)")
    train_env_vars: str | None = flag(None, help="slime's JSON object of environment variables for the training ranks, "
                                      "e.g. '{\"NCCL_DEBUG\": \"INFO\"}'", parse=values.env_json, secret=False)
    recompute_granularity: str | None = flag(None, help="Megatron's activation recompute: any value turns on "
                                             "activation checkpointing of every decoder layer",
                                             choices=("full", "selective"))
    recompute_method: str | None = flag(None, help="Megatron's recompute method (with --recompute-granularity)",
                                        choices=("uniform", "block"))
    recompute_num_layers: int | None = flag(None, help="Megatron's layers per recompute unit (with "
                                            "--recompute-granularity)", minimum=1)

    def check(self) -> None:
        if self.attn_implementation == "triton":  # taken by the choices so that this names what it is
            raise ConfigError("--attn-implementation triton is miles' SGLang Triton attention bridge in training "
                              "(ROCm, true on-policy): not in rayless, whose training attention is transformers' "
                              "(eager, sdpa, flash_attention_2, flash_attention_3, flex_attention)")
        if self.kl_coef and self.kl_loss_coef:
            raise ConfigError("--kl-coef (reward shaping) and --kl-loss-coef (loss term) are both set: slime "
                              "allows only one of them")
        for name, value in (("--adam-beta1", self.adam_beta1), ("--adam-beta2", self.adam_beta2)):
            if value >= 1:
                raise ConfigError(f"{name}: must be < 1, got {value}")
        if self.bf16 and self.fp16:
            raise ConfigError("--bf16 and --fp16 both choose the compute dtype: give one")
        try:  # the rules the ranks' settings hold (one copy: workers.protocol.train_settings)
            self.optimizer_settings()
            self.loss_settings()
            self.batching_settings()
        except SettingsError as exc:
            raise ConfigError(str(exc)) from None
        if self.min_lr > self.lr:
            raise ConfigError(f"--min-lr {self.min_lr} is above --lr {self.lr}")
        if self.lr_warmup_fraction is not None and self.lr_warmup_iters:
            raise ConfigError("--lr-warmup-fraction and --lr-warmup-iters both set the warm-up: give one")

    @property
    def activation_checkpointing(self) -> bool:
        return self.gradient_checkpointing or self.recompute_granularity is not None

    @property
    def compute_dtype(self) -> str | None:
        return "bfloat16" if self.bf16 else "float16" if self.fp16 else None

    def optimizer_settings(self, lr_decay_steps: int | None = None) -> OptimizerSettings:
        """lr_decay_steps: the optimizer steps of the whole run (the decay's default span)."""
        return OptimizerSettings(
            lr=self.lr, min_lr=self.min_lr, lr_decay_style=self.lr_decay_style,
            lr_decay_steps=self.lr_decay_iters or lr_decay_steps, warmup_steps=self.lr_warmup_iters,
            warmup_fraction=self.lr_warmup_fraction, warmup_init_lr=self.lr_warmup_init,
            weight_decay=self.weight_decay, adam_beta1=self.adam_beta1, adam_beta2=self.adam_beta2,
            adam_eps=self.adam_eps, clip_grad=self.clip_grad)

    def loss_settings(self, policy_loss: str = "ppo", *, loss_type: str = "policy_loss",
                      hook_args: dict[str, Any] | None = None) -> LossSettings:
        """policy_loss: "ppo" (per-token ratio) or "gspo" (sequence ratio), from `--advantage-estimator`;
        loss_type: the SFT slice's `--loss-type`; hook_args: the TIS hook's `args` (the hook layer builds them)."""
        return LossSettings(
            policy_loss=policy_loss, loss_type=loss_type, hook_args=hook_args, eps_clip=self.eps_clip, eps_clip_high=self.eps_clip_high,
            eps_clip_c=self.eps_clip_c,
            use_kl_loss=self.use_kl_loss, kl_loss_coef=self.kl_loss_coef, kl_loss_type=self.kl_loss_type,
            entropy_coef=self.entropy_coef, use_rollout_logprobs=self.use_rollout_logprobs,
            use_tis=self.use_tis, tis_clip=self.tis_clip, tis_clip_low=self.tis_clip_low,
            tis_function_path=self.custom_tis_function_path)

    def batching_settings(self, *, one_sample_per_micro_batch: bool = False) -> BatchingSettings:
        """one_sample_per_micro_batch: deterministic mode's rule (the engine scores one sequence at a time;
        packing several into a row changes the attention kernel's shapes)."""
        micro_batch_size = None if self.use_dynamic_batch_size else self.micro_batch_size
        return BatchingSettings(
            max_tokens_per_micro_batch=self.max_tokens_per_gpu, log_probs_chunk_size=self.log_probs_chunk_size,
            micro_batch_size=1 if one_sample_per_micro_batch else micro_batch_size,
            # None: one optimizer step per rollout (always, with miles' dynamic global batch size)
            global_batch_size=None if self.use_dynamic_global_batch_size else self.global_batch_size,
            num_steps_per_rollout=self.num_steps_per_rollout
            if self.global_batch_size is None and not self.use_dynamic_global_batch_size else None,
            dynamic_global_batch_size=self.use_dynamic_global_batch_size)

    def model_settings(self, where: ModelSettings) -> ModelSettings:
        """`where` (the policy's, its reference's and its adapters' paths: other slices decide them) with how
        this slice runs the model: attention kernel, mixed precision, activation checkpointing."""
        return msgspec.structs.replace(where, attn_implementation=self.attn_implementation,
                                       compute_dtype=self.compute_dtype,
                                       gradient_checkpointing=self.activation_checkpointing)

    @property
    def train_env(self) -> tuple[tuple[str, str], ...]:
        """`--train-env-vars` as (name, value) pairs, in the file's order."""
        return values.env_pairs(self.train_env_vars)
