"""The cross-slice rules: each contradiction between flags of different slices is one named function here.

Owns `RULES`, the ordered list `Config.validate()` runs after every slice has checked itself (so a rule may
rely on each slice being valid on its own). A rule reads the config and either returns, warns with
`ConfigWarning` (a flag with no effect, as miles warns), or raises `ConfigError` naming every flag involved.
Adding a rule: write the function, add it to `RULES` where its message should win over later ones.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING

from coordinator.config.critic_rules import CRITIC_RULES
from coordinator.config.determinism_rules import deterministic_runs_can_hold
from coordinator.config.distill import teacher_hook
from coordinator.config.eval_rules import EVAL_FLEET_RULES
from coordinator.config.fields import ConfigError, ConfigWarning
from coordinator.config.rollout import DEFAULT_ROLLOUT_FUNCTION
from coordinator.config.sft_rules import SFT_RULES
from coordinator.config.sglang_file import sglang_config_maps
from coordinator.config.vlm_rules import VLM_RULES
from workers.boundary.exposure import exposure_problem

if TYPE_CHECKING:
    from coordinator.config.settings import Config


def replay_has_no_eval_fleet(config: Config) -> None:
    if config.replay_mode and (config.eval.eval_num_engines or config.eval.eval_num_gpus):
        raise ConfigError("--load-debug-rollout-data starts no engines, so --eval-num-engines/--eval-num-gpus "
                          "(an eval fleet) cannot run: drop one")


def replay_is_not_async(config: Config) -> None:
    if config.replay_mode and config.rollout.async_rollout:
        raise ConfigError("--async-rollout overlaps generation with training; --load-debug-rollout-data "
                          "generates nothing: drop one")


def replay_ignores_engine_flags(config: Config) -> None:
    cluster = config.cluster
    if config.replay_mode and (cluster.rollout_external_engine_addrs or cluster.rollout_num_engines
                               or cluster.rollout_num_gpus):
        warnings.warn("--load-debug-rollout-data starts no engines: --rollout-num-engines / --rollout-num-gpus / "
                      "--rollout-external-engine-addrs are ignored", ConfigWarning, stacklevel=3)


def eval_gpus_fill_whole_engines(config: Config) -> None:
    per_engine = config.eval.eval_num_gpus_per_engine  # miles: the fleet's own TP size
    if config.eval.eval_num_gpus % per_engine:
        raise ConfigError(f"--eval-num-gpus {config.eval.eval_num_gpus} is not divisible by "
                          f"--eval-num-gpus-per-engine {per_engine}")


def ft_components_need_fault_tolerance(config: Config) -> None:
    if "ft_components" in config.given and not config.fault_tolerance.use_fault_tolerance:
        warnings.warn("--ft-components has no effect without --use-fault-tolerance", ConfigWarning, stacklevel=3)


def fault_injection_needs_monitored_engines(config: Config) -> None:
    if config.fault_tolerance.inject_engine_fault_at_rollout is not None and not config.health_monitor_enabled:
        warnings.warn("--inject-engine-fault-at-rollout is armed only with rollout fault tolerance "
                      "(--use-fault-tolerance --ft-components rollout) and rollout engines; it is ignored",
                      ConfigWarning, stacklevel=3)


def generation_needs_engines(config: Config) -> None:
    if config.needs_engines and config.num_rollout_engines == 0:
        raise ConfigError("this run generates rollouts but has no rollout engines: give --rollout-num-engines "
                          "(CPU), --rollout-num-gpus or --rollout-external-engine-addrs, or use "
                          "--debug-train-only / --load-debug-rollout-data")


def router_needs_engines(config: Config) -> None:
    if config.sglang.launches_router and not config.needs_engines:
        flag = "--use-sglang-router" if config.sglang.use_sglang_router else "--sglang-router-port"
        raise ConfigError(f"{flag} needs rollout engines, which this run does not start")


def generation_needs_num_rollout(config: Config) -> None:
    if config.rollout.num_rollout is None and config.sft.num_epoch is None and not config.replay_mode:
        raise ConfigError("--num-rollout is required (how many rollouts to run), or --num-epoch (passes over "
                          "--prompt-data)")


def generation_needs_batch_size(config: Config) -> None:
    if not config.replay_mode and config.rollout.rollout_batch_size is None:
        raise ConfigError("--rollout-batch-size is required (prompt groups per rollout)")


def default_rollout_needs_prompts(config: Config) -> None:
    rollout = config.rollout
    if not config.replay_mode and rollout.rollout_function_path == DEFAULT_ROLLOUT_FUNCTION:
        if rollout.disable_rollout_global_dataset:
            raise ConfigError("--disable-rollout-global-dataset: the default rollout function samples its prompts "
                              "from that dataset; give a --rollout-function-path that manages its own data (as "
                              "slime)")
        if rollout.prompt_data is None:
            raise ConfigError("--prompt-data is required by the default rollout function "
                              "(a JSONL/Parquet file, or builtin:first_digit)")


def routing_replay_needs_a_dense_model(config: Config) -> None:
    """slime's R3 replays the engine's MoE routing in training: rayless' engines return no routed experts, so it
    cannot run on an MoE model; a model without MoE layers has no routing to replay (a no-op, in the notice)."""
    from coordinator.config.porting import model_experts

    flags = [flag for flag, on in (("--use-rollout-routing-replay", config.train.use_rollout_routing_replay),
                                   ("--use-routing-replay", config.train.use_routing_replay)) if on]
    if not flags:
        return
    experts = model_experts(config)
    if experts is None or experts > 0:
        found = (f"{config.rollout.hf_checkpoint} is an MoE model ({experts} experts in config.json)"
                 if experts else "--hf-checkpoint's config.json cannot be read to tell whether the model has MoE "
                 "layers")
        raise ConfigError(f"{' '.join(flags)}: MoE routing replay (R3) needs the engine's routed experts, which "
                          f"rayless' engines do not return; {found}")


def global_batch_divides_rollout(config: Config) -> None:
    rollout, global_batch_size = config.rollout, config.train.global_batch_size
    if config.replay_mode or global_batch_size is None or not rollout.samples_per_rollout % global_batch_size \
            or config.train.use_dynamic_global_batch_size:
        return
    raise ConfigError(
        f"--global-batch-size {global_batch_size} does not divide --rollout-batch-size × "
        f"--n-samples-per-prompt = {rollout.rollout_batch_size} × {rollout.n_samples_per_prompt} = "
        f"{rollout.samples_per_rollout}"
    )


def dynamic_global_batch_needs_dynamic_micro_batches(config: Config) -> None:
    """miles' rule, for static micro-batching (--micro-batch-size without --use-dynamic-batch-size)."""
    train = config.train
    if train.use_dynamic_global_batch_size and train.micro_batch_size is not None and not train.use_dynamic_batch_size:
        raise ConfigError("--use-dynamic-global-batch-size requires --use-dynamic-batch-size (with "
                          "--max-tokens-per-gpu): static micro-batching (--micro-batch-size) cannot guarantee "
                          "alignment when the sample count is data-dependent (miles' rule)")


def global_batch_splits_over_ranks(config: Config) -> None:
    """Any global batch splits over the ranks: a step's samples are split by tokens (`planning.balance_by_tokens`),
    so the ranks' sample counts differ anyway, and every loss term is a token sum over the step's loss tokens of
    all ranks (`train_rank.loss`), the same whatever the split. slime/miles size the batch for their
    data-parallel size (the GPUs ÷ tensor × pipeline × context parallel sizes); under FSDP2 every GPU is a
    data-parallel rank, so a batch smaller than the ranks leaves some idle in each step: said, not refused."""
    if config.replay_mode or not config.needs_train_ranks or config.train.use_dynamic_global_batch_size:
        return  # a dynamic global batch is rounded down to a multiple of the ranks each rollout
    batch, ranks = config.effective_global_batch_size, config.num_train_ranks
    if batch < ranks:
        given = (f"--global-batch-size {batch}" if config.train.global_batch_size
                 else f"the global batch of {batch} sample(s) (the rollout's samples"
                      + (f" / --num-steps-per-rollout {config.train.num_steps_per_rollout})"
                         if config.train.num_steps_per_rollout else ")"))
        warnings.warn(
            f"{given} is smaller than the {ranks} training ranks (--actor-num-nodes × "
            f"--actor-num-gpus-per-node): rayless trains FSDP2 data parallel over every rank, where slime/miles "
            f"split the batch over their data-parallel size, so {ranks - batch} rank(s) get no sample in each step "
            "and run an empty micro-batch; a global batch of at least the ranks uses them all",
            ConfigWarning, stacklevel=3)


def steps_per_rollout_agree(config: Config) -> None:
    """slime: --num-steps-per-rollout N sets --global-batch-size to the rollout's samples / N; both must agree."""
    steps, samples = config.train.num_steps_per_rollout, config.rollout.samples_per_rollout
    if config.replay_mode or steps is None or not samples:
        return
    if config.train.use_dynamic_global_batch_size and steps != 1:
        raise ConfigError(f"--use-dynamic-global-batch-size requires exactly one optimizer step per rollout; got "
                          f"--num-steps-per-rollout {steps}")
    if samples % steps:
        raise ConfigError(f"--num-steps-per-rollout {steps} does not divide --rollout-batch-size × "
                          f"--n-samples-per-prompt = {samples}")
    gbs = config.train.global_batch_size
    if gbs is not None and gbs != samples // steps:
        raise ConfigError(f"--global-batch-size {gbs} and --num-steps-per-rollout {steps} disagree: {steps} "
                          f"steps of {samples} samples make a global batch of {samples // steps}")


def eval_fleet_needs_schedule(config: Config) -> None:
    if config.eval_fleet_enabled and (config.eval.eval_interval is None or not config.eval.dataset_specs):
        raise ConfigError("an eval fleet (--eval-num-engines/--eval-num-gpus) needs --eval-interval and "
                          "--eval-prompt-data (or --eval-config)")


def eval_interval_needs_datasets(config: Config) -> None:
    if config.eval.eval_interval is not None and not config.eval.dataset_specs:
        raise ConfigError("--eval-interval needs something to evaluate: --eval-prompt-data NAME PATH ... or "
                          "--eval-config FILE")


def eval_datasets_need_interval(config: Config) -> None:
    if config.eval.dataset_specs and config.eval.eval_interval is None:
        warnings.warn("eval datasets are given but no --eval-interval: they are never evaluated (as in slime)",
                      ConfigWarning, stacklevel=3)


def eval_needs_engines(config: Config) -> None:
    """Eval on the rollout engines needs them; replay and --debug-train-only start none (slime would fail)."""
    if config.eval.eval_interval is not None and not config.needs_engines:
        mode = ("--load-debug-rollout-data" if config.replay_mode else "--debug-train-only"
                if config.debug.debug_train_only else "--loss-type sft_loss")
        warnings.warn(f"{mode} starts no engines: --eval-interval is ignored and nothing is evaluated",
                      ConfigWarning, stacklevel=3)


def async_rollout_needs_training(config: Config) -> None:
    if config.rollout.async_rollout and not config.needs_train_ranks:
        raise ConfigError("--async-rollout overlaps generation with training; --debug-rollout-only has no "
                          "training: drop one")


def async_rollout_does_not_abort_on_update(config: Config) -> None:
    """miles refuses it too: with generation spanning weight updates, abort would end every in-flight request
    at each update."""
    if config.rollout.async_rollout and config.sglang.pause_generation_mode == "abort":
        raise ConfigError("--pause-generation-mode abort with --async-rollout (or --fully-async): every weight "
                          "update would end the requests in flight; use in_place (the default) or retract")


def session_server_does_not_abort_on_update(config: Config) -> None:
    """miles' check: an abort at each weight update would cut agent sessions mid-turn."""
    if config.hooks.use_session_server is not None and config.sglang.pause_generation_mode == "abort":
        raise ConfigError("--use-session-server is incompatible with --pause-generation-mode=abort")


def skipped_forward_pass_needs_one_step(config: Config) -> None:
    """miles' `--skip-actor-forward-only` asserts one optimizer step per rollout (miles/utils/arguments.py):
    the old logprobs are then the step's own forward, which is what rayless does for a rollout's first step."""
    if not config.train.skip_actor_forward_only:
        return
    if config.lora.enabled and config.lora.lora_dropout:
        raise ConfigError("--skip-actor-forward-only with --lora-dropout: miles refuses the pair (with dropout the "
                          "old logprobs need a forward-only pass with it off): drop one")
    if not config.rollout.samples_per_rollout:
        return  # a replay's rollout size comes from its dumps: the one-step rule is checked where it is known
    steps = config.train_steps_per_rollout
    if steps != 1:
        raise ConfigError(f"--skip-actor-forward-only needs one optimizer step per rollout (miles' rule: the old "
                          f"logprobs are then the step's own forward), but --global-batch-size "
                          f"{config.effective_global_batch_size} makes {steps} steps of the rollout's "
                          f"{config.rollout.samples_per_rollout} samples: drop one, or make the global batch the "
                          "whole rollout")


def p2p_transfer_is_miles_own(config: Config) -> None:
    """miles' `--update-weight-transfer-mode p2p` asserts no --colocate and no LoRA (miles/utils/arguments.py);
    rayless runs it as its distributed transfer, which holds those rules too so a miles script means the same."""
    if config.sglang.update_weight_transfer_mode != "p2p":
        return
    if config.cluster.colocate:
        raise ConfigError("--update-weight-transfer-mode p2p with --colocate: miles refuses the pair (colocated "
                          "weights move by disk here): drop one")
    if config.lora.enabled:
        raise ConfigError("--update-weight-transfer-mode p2p with LoRA (--lora-rank): miles refuses the pair "
                          "(no LoRA weight sync over p2p): use --update-weight-transfer-mode broadcast")


def colocation_is_not_async(config: Config) -> None:
    if config.cluster.colocate and config.rollout.async_rollout:
        raise ConfigError("--colocate and --async-rollout: colocated engines and ranks take turns on the same "
                          "GPUs, so generation cannot overlap training: drop one")


def colocation_needs_both_halves(config: Config) -> None:
    """slime turns --colocate off with --debug-rollout-only; with nothing to share the GPUs with, it is a no-op."""
    if config.cluster.colocate and not config.colocated:
        mode = ("--debug-rollout-only (no training ranks)" if not config.needs_train_ranks
                else "--load-debug-rollout-data / --debug-train-only (no engines)")
        warnings.warn(f"--colocate has no effect with {mode}: nothing shares the GPUs", ConfigWarning,
                      stacklevel=3)
    given = [flag for flag, name in (("--offload-train", "offload_train"), ("--offload-rollout", "offload_rollout"))
             if getattr(config.cluster, name) and not (config.needs_engines and config.needs_train_ranks)]
    if given:
        warnings.warn(f"{' / '.join(given)}: no effect in a run that does not both generate and train",
                      ConfigWarning, stacklevel=3)


#: Run in this order by `validate()`; the first that raises names the contradiction the user sees.
def eval_fleet_generates_without_hooks(config: Config) -> None:
    if not config.eval_fleet_enabled:
        return
    hook = ("--custom-generate-function-path" if config.hooks.custom_generate_function_path is not None
            else "--eval-function-path" if config.rollout.eval_function_path is not None else None)
    if hook is not None:
        warnings.warn(f"{hook} runs on the rollout engines; the dedicated eval fleet "
                      "(--eval-num-engines/--eval-num-gpus) evaluates with the built-in single-turn request code"
                      + (" (a CheckpointEvalFn there is refused at start-up: it is an eval backend of its own, "
                         "as in miles)" if hook == "--eval-function-path" else ""),
                      ConfigWarning, stacklevel=3)


def tis_hook_needs_tis(config: Config) -> None:
    if config.train.custom_tis_function_path is not None and not config.train.use_tis:
        warnings.warn("--custom-tis-function-path replaces the TIS weight of --use-tis, which is off: it is not "
                      "called (slime reads use_tis from --custom-config-path files too)", ConfigWarning,
                      stacklevel=3)


def distillation_has_a_teacher(config: Config) -> None:
    """`--opd-type sglang` asks a teacher engine during the rollout: one must be named (a replayed dump holds
    the teacher logprobs already); slime's OPD reward hooks are that teacher, so they need `--use-opd`."""
    distill = config.distill
    opd_hooks = [path for path in (config.rollout.custom_rm_path, config.rollout.custom_reward_post_process_path)
                 if path is not None and path.startswith("coordinator.rollout.teacher:")]
    if opd_hooks and not distill.use_opd:
        raise ConfigError(f"{opd_hooks[0]} (slime's on-policy distillation reward: 0, the teacher gives the "
                          "signal) without --use-opd would train on nothing: add --use-opd --opd-type sglang")
    if (distill.engine_teacher and not config.replay_mode and not distill.launches_teacher
            and not distill.teacher_routes(config.rollout.rm_url, config.rollout.rm_type)
            and teacher_hook(config.rollout, config.hooks) is None):
        raise ConfigError("--use-opd --opd-type sglang needs its teacher: --opd-teacher-urls NAME=URL (running "
                          "engines), --opd-teacher-load DIR (rayless serves it), --rm-url (slime's single "
                          "teacher), or a custom generate / rollout / reward hook that sets "
                          "sample.teacher_log_probs itself (slime's contract)")
    if distill.top_k is not None and not config.replay_mode:
        has_address = distill.launches_teacher or distill.teacher_routes(config.rollout.rm_url, config.rollout.rm_type)
        hook = teacher_hook(config.rollout, config.hooks)
        if not has_address:
            raise ConfigError(f"--opd-log-prob-top-k {distill.opd_log_prob_top_k}: top-k OPD asks the teacher's "
                              "engine itself; give it (--opd-teacher-urls, --opd-teacher-load or --rm-url) rather "
                              f"than a hook ({hook}) that sets teacher logprobs")
        generate = config.hooks.custom_generate_function_path or (
            None if config.rollout.rollout_function_path == DEFAULT_ROLLOUT_FUNCTION
            else config.rollout.rollout_function_path)
        if distill.top_k.student_top and generate is not None:
            raise ConfigError(f"--opd-top-k-strategy {distill.opd_top_k_strategy} reads the student's top-k "
                              f"logprobs, which only rayless' own generate asks the engines for, not {generate}; "
                              "use --opd-top-k-strategy only-teacher (as miles outside its v1 rollout)")


def servers_beyond_loopback_need_a_key(config: Config) -> None:
    """The status server and the session server listen beyond loopback only with the run's key (they ask every
    client for it) or an explicit --allow-unauthenticated (engines on other nodes: `plan.placement`)."""
    servers = []
    if config.logging.status_port:
        servers.append(("--status-host", config.logging.status_host))
    if config.hooks.use_session_server:
        servers.append(("--session-server-ip", config.hooks.session_server_ip))
    for flag_name, host in servers:
        problem = exposure_problem(host, has_key=bool(config.sglang.sglang_api_key),
                                   allowed=config.sglang.allow_unauthenticated, host_flag=flag_name,
                                   key_flag="--sglang-api-key")
        if problem:
            raise ConfigError(problem)


RULES: tuple[Callable[[Config], None], ...] = (
    replay_has_no_eval_fleet,
    routing_replay_needs_a_dense_model,
    replay_is_not_async,
    replay_ignores_engine_flags,
    eval_gpus_fill_whole_engines,
    *EVAL_FLEET_RULES,
    ft_components_need_fault_tolerance,
    fault_injection_needs_monitored_engines,
    *VLM_RULES,
    *SFT_RULES,  # before the engine rules: an SFT run's refusal says why engines cannot mean anything in it
    generation_needs_engines,
    router_needs_engines,
    sglang_config_maps,
    generation_needs_num_rollout,
    generation_needs_batch_size,
    default_rollout_needs_prompts,
    global_batch_divides_rollout,
    steps_per_rollout_agree,
    dynamic_global_batch_needs_dynamic_micro_batches,
    global_batch_splits_over_ranks,
    *CRITIC_RULES,
    eval_fleet_needs_schedule,
    eval_interval_needs_datasets,
    eval_datasets_need_interval,
    eval_needs_engines,
    async_rollout_needs_training,
    eval_fleet_generates_without_hooks,
    tis_hook_needs_tis,
    async_rollout_does_not_abort_on_update,
    session_server_does_not_abort_on_update,
    p2p_transfer_is_miles_own,
    skipped_forward_pass_needs_one_step,
    colocation_is_not_async,
    colocation_needs_both_halves,
    deterministic_runs_can_hold,
    distillation_has_a_teacher,
    servers_beyond_loopback_need_a_key,
)


def validate(config: Config) -> None:
    """Raise `ConfigError` on the first contradiction, naming the flags; warn on flags with no effect: every
    slice's own checks first, then each rule of `RULES` in order."""
    from coordinator.config.flags import SLICES

    for attribute, _ in SLICES:
        getattr(config, attribute).validate()
    for rule in RULES:
        rule(config)
