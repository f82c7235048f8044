"""The mode table (one test per row) and the start-up validation rules (one test per rule)."""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path

import pytest

from coordinator.config import RULES, Config, ConfigError, ConfigWarning, config_from_mapping, parse_config
from coordinator.train.settings import train_settings

BASE = ["--hf-checkpoint", "/model", "--rollout-batch-size", "4", "--n-samples-per-prompt", "2",
        "--num-rollout", "3", "--prompt-data", "builtin:first_digit"]


def cfg(*extra: str) -> Config:
    return parse_config([*BASE, *extra])


# --- mode table ---------------------------------------------------------------------------------------------
def test_replay_mode_is_load_debug_rollout_data_set_and_builds_nothing_that_generates() -> None:
    config = cfg("--load-debug-rollout-data", "d/{rollout_id}.rld", "--use-fault-tolerance",
                 "--ft-components", "rollout,train")
    assert config.replay_mode and config.train_only
    assert not config.builds_rollout_fn
    assert not config.needs_engines
    assert config.num_rollout_engines == 0 and config.num_eval_engines == 0
    assert not config.health_monitor_enabled  # even with rollout FT asked for
    assert not config.eval_fleet_enabled
    with pytest.raises(ConfigError, match="without rollout engines"):
        _ = config.generate_concurrency


def test_replay_mode_with_empty_template_string_still_counts_as_set() -> None:
    # `is not None`, not truthiness: an empty template is an error, not a silent fall-back to generation.
    with pytest.raises(ConfigError, match=r"--load-debug-rollout-data: '' must contain '\{rollout_id\}'"):
        cfg("--load-debug-rollout-data", "")


def test_debug_train_only_keeps_the_rollout_fn_but_starts_no_engines() -> None:
    config = cfg("--debug-train-only")
    assert config.train_only and not config.replay_mode
    assert config.builds_rollout_fn
    assert not config.needs_engines and config.num_rollout_engines == 0
    assert config.needs_train_ranks


def test_debug_rollout_only_starts_no_training_ranks() -> None:
    config = cfg("--debug-rollout-only", "--rollout-num-engines", "2")
    assert not config.needs_train_ranks and config.num_train_ranks == 0
    assert config.needs_engines and config.num_rollout_engines == 2


@pytest.mark.parametrize(
    ("flags", "rollout_ft", "train_ft"),
    [
        ([], False, False),
        (["--use-fault-tolerance"], True, False),  # default components: {"rollout"}, as in miles
        (["--use-fault-tolerance", "--ft-components", "train"], False, True),
        (["--use-fault-tolerance", "--ft-components", "rollout,train"], True, True),
        (["--use-fault-tolerance", "--ft-components", "rollout", "train"], True, True),  # miles' spaced form
    ],
)
def test_fault_tolerance_components(flags: list[str], rollout_ft: bool, train_ft: bool) -> None:
    config = cfg("--rollout-num-engines", "1", *flags)
    assert config.rollout_ft_enabled is rollout_ft
    assert config.train_ft_enabled is train_ft
    assert config.health_monitor_enabled is rollout_ft
    assert isinstance(config.ft_components, frozenset) and config.ft_components


def test_generate_concurrency_counts_launched_and_external_engines() -> None:
    config = cfg("--rollout-num-engines", "2", "--rollout-external-engine-addrs", "127.0.0.1:1", "127.0.0.1:2",
                 "--sglang-server-concurrency", "8")
    assert config.num_rollout_engines == 4
    assert config.generate_concurrency == 32
    gpu = cfg("--rollout-num-gpus", "8", "--rollout-num-gpus-per-engine", "2")
    assert gpu.num_rollout_engines == 4 and gpu.generate_concurrency == 4 * 512


def test_fault_injection_is_armed_only_with_rollout_ft() -> None:
    with pytest.warns(ConfigWarning, match="armed only"):
        train_only_ft = cfg("--rollout-num-engines", "1", "--use-fault-tolerance", "--ft-components", "train",
                            "--inject-engine-fault-at-rollout", "1")
    assert not train_only_ft.fault_injection_armed
    armed = cfg("--rollout-num-engines", "1", "--use-fault-tolerance", "--inject-engine-fault-at-rollout", "1")
    assert armed.fault_injection_armed and armed.fault_injection_rollout == 1
    ci = cfg("--rollout-num-engines", "1", "--use-fault-tolerance", "--ci-test")
    assert ci.fault_injection_armed and ci.fault_injection_rollout == 1
    ci_without_rollout_ft = cfg("--rollout-num-engines", "1", "--use-fault-tolerance", "--ft-components", "train",
                                "--ci-test")
    assert not ci_without_rollout_ft.fault_injection_armed


def test_shared_rollout_and_eval_fn() -> None:
    assert cfg("--rollout-num-engines", "1").rollout.shares_rollout_and_eval_fn
    other = cfg("--rollout-num-engines", "1", "--eval-function-path", "x.y:Z")
    assert not other.rollout.shares_rollout_and_eval_fn


def test_ft_components_without_use_fault_tolerance_warns() -> None:
    with pytest.warns(ConfigWarning, match="--ft-components has no effect without --use-fault-tolerance"):
        config = cfg("--rollout-num-engines", "1", "--ft-components", "train")
    assert not config.train_ft_enabled


def test_config_file_supplies_flags_and_command_line_wins(tmp_path: Path) -> None:
    yaml_file = tmp_path / "job.yaml"
    yaml_file.write_text("rollout-num-engines: 3\nlr: 0.5\nuse_fault_tolerance: true\nft_components: [rollout, train]\n")
    config = cfg("--config", str(yaml_file), "--lr", "0.25")
    assert config.num_rollout_engines == 3 and config.train.lr == 0.25
    assert config.ft_components == {"rollout", "train"}
    toml_file = tmp_path / "job.toml"
    toml_file.write_text("rollout_num_engines = 2\nsglang_server_concurrency = 4\n")
    assert cfg("--config", str(toml_file)).generate_concurrency == 8
    bad = tmp_path / "bad.toml"
    bad.write_text("no_such_flag = 1\n")
    with pytest.raises(ConfigError, match="unknown flag 'no_such_flag'"):
        cfg("--config", str(bad))


def test_sglang_passthrough_strips_the_prefix() -> None:
    config = cfg("--rollout-num-engines", "1", "--sglang-mem-fraction-static", "0.8", "--sglang-enable-metrics")
    assert config.sglang.sglang_passthrough == ("--mem-fraction-static", "0.8", "--enable-metrics")


def test_eval_sglang_overrides_are_the_eval_fleets_own_and_the_launcher_keeps_its_arguments() -> None:
    fleet = ["--rollout-num-engines", "1", "--eval-num-engines", "1", "--eval-interval", "1", "--eval-prompt-data",
             "d", "builtin:first_digit"]
    config = cfg(*fleet, "--sglang-mem-fraction-static", "0.7", "--eval-sglang-mem-fraction-static", "0.9",
                 "--no-eval-sglang-enable-metrics")
    assert config.sglang.sglang_passthrough == ("--mem-fraction-static", "0.7")
    assert config.eval.eval_sglang_passthrough == ("--mem-fraction-static", "0.9", "--no-enable-metrics")
    assert json.loads(config.to_json())["eval_sglang_passthrough"] == ["--mem-fraction-static", "0.9",
                                                                       "--no-enable-metrics"]
    with pytest.raises(ConfigError, match="--eval-sglang-tp-size: not an eval-fleet override "
                                          r"\(--eval-num-gpus-per-engine sets the eval engines' TP size"):
        cfg(*fleet, "--eval-sglang-tp-size", "2")


def test_dynamic_global_batch_size_is_one_step_per_rollout_whatever_the_global_batch_size() -> None:
    config = cfg("--rollout-num-engines", "1", "--use-dynamic-global-batch-size", "--global-batch-size", "3")
    batching = config.train.batching_settings()
    assert batching.dynamic_global_batch_size and batching.global_batch_size is None
    assert batching.num_steps_per_rollout is None and config.train_steps_per_rollout == 1
    with pytest.raises(ConfigError, match="requires exactly one optimizer step per rollout; got "
                                          "--num-steps-per-rollout 2"):
        cfg("--rollout-num-engines", "1", "--use-dynamic-global-batch-size", "--num-steps-per-rollout", "2")


def test_resolved_config_json_hides_the_api_key() -> None:
    config = cfg("--rollout-num-engines", "1", "--sglang-api-key", "secret")
    data = json.loads(config.to_json())
    assert data["sglang_api_key"] == "***" and data["rollout_num_engines"] == 1


def test_config_is_frozen() -> None:
    config = config_from_mapping({"hf_checkpoint": "/m"})
    with pytest.raises(AttributeError):
        config.train.lr = 1.0  # type: ignore[misc]
    with pytest.raises(AttributeError):
        config.train = config.train  # type: ignore[misc]


def test_parse_errors_do_not_warn_twice() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg("--rollout-num-engines", "1")  # a clean config raises no warning at all


# --- the named cross-slice rules: one case per rule, and every rule has one ----------------------------------
# rule name → (a flag of BASE to drop with its value, flags to add, the error — or "warning: ..." — expected)
RULE_CASES: dict[str, tuple[str | None, list[str], str]] = {
    "replay_has_no_eval_fleet": (None, ["--load-debug-rollout-data", "d/{rollout_id}", "--eval-num-engines", "1"],
                                 "--eval-num-engines/--eval-num-gpus (an eval fleet) cannot run"),
    "replay_is_not_async": (None, ["--load-debug-rollout-data", "d/{rollout_id}", "--async-rollout"],
                            "--load-debug-rollout-data generates nothing"),
    "replay_ignores_engine_flags": (None, ["--load-debug-rollout-data", "d/{rollout_id}", "--rollout-num-engines",
                                           "1"], "warning: --rollout-num-engines / --rollout-num-gpus"),
    "eval_gpus_fill_whole_engines": (None, ["--rollout-num-gpus", "2", "--eval-num-gpus-per-engine", "2",
                                            "--eval-num-gpus", "3"],
                                     "--eval-num-gpus 3 is not divisible by --eval-num-gpus-per-engine 2"),
    "dynamic_global_batch_needs_dynamic_micro_batches": (None, ["--rollout-num-engines", "1",
                                                                "--use-dynamic-global-batch-size",
                                                                "--micro-batch-size", "2"],
                                                         "--use-dynamic-global-batch-size requires "
                                                         "--use-dynamic-batch-size"),
    "eval_sglang_overrides_need_a_fleet": (None, ["--rollout-num-engines", "1", "--eval-sglang-mem-fraction-static",
                                                  "0.9"], "--eval-sglang-* configures the dedicated eval fleet, "
                                                          "which needs --eval-num-gpus"),
    "eval_fleet_is_not_colocated": (None, ["--colocate", "--eval-num-gpus", "1",
                                           "--eval-interval", "1", "--eval-prompt-data", "d", "builtin:first_digit"],
                                    "snapshot eval is not supported with --colocate"),
    "eval_fleet_is_not_in_a_debug_mode": (None, ["--rollout-num-engines", "1", "--debug-rollout-only",
                                                 "--eval-num-engines", "1", "--eval-interval", "1",
                                                 "--eval-prompt-data", "d", "builtin:first_digit"],
                                          "with --debug-rollout-only: snapshot eval is not supported"),
    "eval_fleet_reuses_save_hf_on_its_cadence": (None, ["--rollout-num-engines", "1", "--eval-num-engines", "1",
                                                        "--eval-interval", "3", "--eval-prompt-data", "d",
                                                        "builtin:first_digit", "--save-hf", "/tmp/hf/{rollout_id}",
                                                        "--save-interval", "2"],
                                                 "requires eval_interval to be a multiple of save_interval (got "
                                                 "eval_interval=3, save_interval=2)"),
    "eval_fleet_flags_need_a_fleet": (None, ["--rollout-num-engines", "1", "--eval-hf-dir", "/tmp/e",
                                             "--eval-overflow-policy", "skip"],
                                      "warning: --eval-hf-dir / --eval-overflow-policy: no effect without a "
                                      "dedicated eval fleet"),
    "ft_components_need_fault_tolerance": (None, ["--rollout-num-engines", "1", "--ft-components", "train"],
                                           "warning: --ft-components has no effect"),
    "fault_injection_needs_monitored_engines": (None, ["--rollout-num-engines", "1",
                                                       "--inject-engine-fault-at-rollout", "1"],
                                                "warning: --inject-engine-fault-at-rollout is armed only"),
    "generation_needs_engines": (None, [], "has no rollout engines"),
    "router_needs_engines": (None, ["--debug-train-only", "--use-sglang-router"], "--use-sglang-router needs"),
    "sglang_config_maps": (None, ["--rollout-num-engines", "1", "--sglang-config", "/nonexistent/sglang.yaml"],
                           "--sglang-config /nonexistent/sglang.yaml: no such file"),
    "generation_needs_num_rollout": ("--num-rollout", ["--rollout-num-engines", "1"], "--num-rollout is required"),
    "generation_needs_batch_size": ("--rollout-batch-size", ["--rollout-num-engines", "1"],
                                    "--rollout-batch-size is required"),
    "default_rollout_needs_prompts": ("--prompt-data", ["--rollout-num-engines", "1"], "--prompt-data is required"),
    "global_batch_divides_rollout": (None, ["--rollout-num-engines", "1", "--global-batch-size", "3"],
                                     "--global-batch-size 3 does not divide"),
    "global_batch_splits_over_ranks": (None, ["--rollout-num-engines", "1", "--actor-num-gpus-per-node", "16"],
                                       "warning: the global batch of 8 sample(s) (the rollout's samples) is "
                                       "smaller than the 16 training ranks "
                                       "(--actor-num-nodes × --actor-num-gpus-per-node): rayless trains FSDP2 data "
                                       "parallel over every rank, where slime/miles split the batch over their "
                                       "data-parallel size, so 8 rank(s) get no sample in each step"),
    "steps_per_rollout_agree": (None, ["--rollout-num-engines", "1", "--global-batch-size", "8",
                                       "--num-steps-per-rollout", "2"], "--global-batch-size 8 and --num-steps-per-rollout 2 disagree"),
    "kl_reward_shaping_is_supported": (None, ["--rollout-num-engines", "1", "--kl-coef", "0.1",
                                              "--advantage-estimator", "reinforce_plus_plus_baseline",
                                              "--normalize-advantages"], "needs per-token rewards"),
    "async_ppo_needs_a_correction": (None, ["--rollout-num-engines", "1", "--advantage-estimator", "ppo",
                                            "--fully-async"],
                                     "--async-rollout / --fully-async with --advantage-estimator ppo needs an explicit off-policy "
                                     "correction (as miles, PR #1829): rollouts are generated before the current "
                                     "weight update while the old logprobs are recomputed by the current policy. "
                                     "Pass one of: --use-rollout-logprobs"),
    "critic_combines": (None, ["--rollout-num-engines", "1", "--advantage-estimator", "ppo", "--lora-rank", "4",
                               "--target-modules", "all-linear"],
                        "--advantage-estimator ppo (a critic) with --lora-rank"),
    "eval_fleet_needs_schedule": (None, ["--rollout-num-engines", "1", "--eval-num-engines", "1"],
                                  "needs --eval-interval and --eval-prompt-data"),
    "eval_interval_needs_datasets": (None, ["--rollout-num-engines", "1", "--eval-interval", "2"],
                                     "--eval-interval needs something to evaluate"),
    "eval_datasets_need_interval": (None, ["--rollout-num-engines", "1", "--eval-prompt-data", "d",
                                           "builtin:first_digit"], "warning: eval datasets are given but no "
                                                                   "--eval-interval"),
    "eval_needs_engines": (None, ["--debug-train-only", "--eval-interval", "1", "--eval-prompt-data", "d",
                                  "builtin:first_digit"], "warning: --debug-train-only starts no engines: "
                                                          "--eval-interval is ignored"),
    "async_rollout_needs_training": (None, ["--rollout-num-engines", "1", "--debug-rollout-only",
                                            "--async-rollout"], "--debug-rollout-only has no training"),
    "eval_fleet_generates_without_hooks": (None, ["--rollout-num-engines", "1", "--eval-num-engines", "1",
                                                  "--eval-interval", "1", "--eval-prompt-data", "d",
                                                  "builtin:first_digit", "--custom-generate-function-path",
                                                  "m:generate"],
                                           "warning: the dedicated eval fleet (--eval-num-engines/--eval-num-gpus) "
                                           "evaluates with the built-in"),
    "deterministic_runs_can_hold": (None, ["--rollout-num-engines", "1", "--deterministic-mode", "--partial-rollout"],
                                    "--deterministic-mode and --partial-rollout"),
    "tis_hook_needs_tis": (None, ["--rollout-num-engines", "1", "--custom-tis-function-path", "m:tis"],
                           "warning: --custom-tis-function-path replaces the TIS weight of --use-tis, which is off"),
    "async_rollout_does_not_abort_on_update": (None, ["--rollout-num-engines", "1", "--async-rollout",
                                                      "--pause-generation-mode", "abort"],
                                               "--pause-generation-mode abort with --async-rollout"),
    "session_server_does_not_abort_on_update": (None, ["--rollout-num-engines", "1", "--use-session-server",
                                                       "--pause-generation-mode", "abort"],
                                                "--use-session-server is incompatible with --pause-generation-mode"),
    "routing_replay_needs_a_dense_model": (None, ["--rollout-num-engines", "1", "--use-rollout-routing-replay"],
                                           "--use-rollout-routing-replay: MoE routing replay (R3) needs the "
                                           "engine's routed experts"),
    "p2p_transfer_is_miles_own": (None, ["--rollout-num-engines", "1", "--update-weight-transfer-mode", "p2p",
                                         "--colocate"],
                                  "--update-weight-transfer-mode p2p with --colocate: miles refuses the pair"),
    "skipped_forward_pass_needs_one_step": (None, ["--rollout-num-engines", "1", "--skip-actor-forward-only",
                                                   "--num-steps-per-rollout", "2"],
                                            "--skip-actor-forward-only needs one optimizer step per rollout"),
    "colocation_is_not_async": (None, ["--colocate", "--async-rollout"],
                                "--colocate and --async-rollout: colocated engines and ranks take turns"),
    "colocation_needs_both_halves": (None, ["--rollout-num-engines", "1", "--colocate", "--debug-rollout-only"],
                                     "warning: --colocate has no effect with --debug-rollout-only"),
    "images_need_a_vlm": (None, ["--rollout-num-engines", "1", "--multimodal-keys", '{"image": "images"}'],
                          "--prompt-data builtin:first_digit is text only: drop --multimodal-keys"),
    "sft_trains_without_engines": (None, ["--loss-type", "sft_loss", "--rollout-num-engines", "1"],
                                   "--rollout-num-engines cannot mean anything in such a run"),
    "sft_has_no_policy_terms": (None, ["--loss-type", "sft_loss", "--use-kl-loss"],
                                "--use-kl-loss: terms of the policy loss (policy_loss)"),
    "sft_rollout_pairs_with_sft_loss": (None, ["--loss-type", "sft_loss"],
                                        "the default rollout function cannot generate"),
    "num_epoch_needs_a_dataset": ("--num-rollout", ["--num-epoch", "2", "--load-debug-rollout-data", "d/{rollout_id}"],
                                  "--num-epoch counts passes over --prompt-data; --load-debug-rollout-data replays"),
    "distillation_has_a_teacher": (None, ["--rollout-num-engines", "1", "--use-opd", "--opd-type", "sglang"],
                                   "--use-opd --opd-type sglang needs its teacher"),
    "servers_beyond_loopback_need_a_key": (None, ["--rollout-num-engines", "1", "--status-port", "8265",
                                                  "--status-host", "0.0.0.0"],
                                           "--status-host 0.0.0.0 listens beyond this machine's loopback without "
                                           "a key: give --sglang-api-key KEY"),
}


def test_every_named_rule_has_a_case() -> None:
    assert sorted(RULE_CASES) == sorted(rule.__name__ for rule in RULES)


@pytest.mark.parametrize("rule", list(RULE_CASES))
def test_each_named_rule_fires_on_its_contradiction(rule: str) -> None:
    drop, flags, expected = RULE_CASES[rule]
    argv = list(BASE)
    if drop is not None:
        del argv[argv.index(drop):argv.index(drop) + 2]
    if expected.startswith("warning: "):
        with pytest.warns(ConfigWarning, match=re.escape(expected.removeprefix("warning: "))):
            parse_config([*argv, *flags])
    else:
        with pytest.raises(ConfigError, match=re.escape(expected)):
            parse_config([*argv, *flags])


def test_a_global_batch_that_is_not_a_multiple_of_the_ranks_is_taken() -> None:
    """miles' multi-node scripts size --global-batch-size for their data-parallel size, not the GPU count; a step's
    samples are split by tokens anyway (tests/integration/test_train_sharded.py trains 3 on 2 ranks)."""
    config = cfg("--rollout-num-engines", "1", "--actor-num-gpus-per-node", "3")
    assert config.effective_global_batch_size == 8 and config.num_train_ranks == 3
    with pytest.warns(ConfigWarning, match=re.escape("the global batch of 8 sample(s) (the rollout's samples) is "
                                                     "smaller than the 9 training ranks")):
        cfg("--rollout-num-engines", "1", "--actor-num-gpus-per-node", "9")
    with pytest.warns(ConfigWarning, match=re.escape("--global-batch-size 4 is smaller than the 6 training ranks")):
        cfg("--rollout-num-engines", "1", "--actor-num-gpus-per-node", "6", "--global-batch-size", "4")
    with pytest.warns(ConfigWarning, match=re.escape("the global batch of 4 sample(s) (the rollout's samples / "
                                                     "--num-steps-per-rollout 2) is smaller than the 5")):
        cfg("--rollout-num-engines", "1", "--actor-num-gpus-per-node", "5", "--num-steps-per-rollout", "2")


@pytest.mark.parametrize("correction", ["--use-rollout-logprobs", "--use-tis"])
def test_async_ppo_runs_with_either_of_miles_corrections(correction: str) -> None:
    config = cfg("--rollout-num-engines", "1", "--advantage-estimator", "ppo", "--async-rollout", correction)
    assert train_settings(config).critic is not None


def test_miles_p2p_transfer_runs_as_distributed_and_keeps_miles_rules() -> None:
    # miles' p2p (RDMA from each rank) carries the same weights: rayless runs its distributed transfer and says so
    from coordinator.config.porting import porting_notice
    from coordinator.weights.sync import TRANSFER_MODES

    config = cfg("--rollout-num-engines", "1", "--update-weight-transfer-mode", "p2p")
    assert TRANSFER_MODES[config.sglang.update_weight_transfer_mode] == "distributed"
    assert "--update-weight-transfer-mode p2p → distributed" in (porting_notice(config) or "")
    # miles asserts no LoRA with p2p (miles/utils/arguments.py); the colocate half is RULE_CASES'
    with pytest.raises(ConfigError, match=re.escape("--update-weight-transfer-mode p2p with LoRA")):
        cfg("--rollout-num-engines", "1", "--update-weight-transfer-mode", "p2p", "--lora-rank", "8",
            "--target-modules", "all-linear")


def test_miles_router_policies_are_taken_and_said_or_refused_where_the_launched_router_lacks_them() -> None:
    # miles' GLM-5.2 launcher gives --sglang-router-policy consistent_hashing (sglang-router's policy_from_str has it)
    from coordinator.config.porting import porting_notice

    config = cfg("--rollout-num-engines", "1", "--sglang-router-policy", "consistent_hashing")
    assert "--sglang-router-policy consistent_hashing: no sglang-router is launched" in (porting_notice(config) or "")
    # the router rayless launches takes five policies on its command line; the others are refused naming them
    cfg("--rollout-num-engines", "1", "--use-sglang-router", "--sglang-router-policy", "manual")
    with pytest.raises(ConfigError, match=re.escape("--sglang-router-policy consistent_hashing: the sglang-router "
                                                    "rayless launches takes --policy random | round_robin")):
        cfg("--rollout-num-engines", "1", "--use-sglang-router", "--sglang-router-policy", "consistent_hashing")


def test_miles_triton_attention_bridge_is_refused_by_name_not_as_an_invalid_choice() -> None:
    # miles' examples/infra_features/true_on_policy/run_simple_amd_triton.py gives it
    with pytest.raises(ConfigError, match=re.escape("--attn-implementation triton is miles' SGLang Triton "
                                                    "attention bridge")):
        cfg("--rollout-num-engines", "1", "--attn-implementation", "triton")


def test_miles_disk_delta_transfer_is_refused_by_name_not_as_an_invalid_choice() -> None:
    with pytest.raises(ConfigError, match=re.escape("--update-weight-transfer-mode disk-delta (miles'")) as info:
        cfg("--rollout-num-engines", "1", "--update-weight-transfer-mode", "disk-delta")
    assert "--update-weight-mode delta" in str(info.value) and "not a valid choice" not in str(info.value)


def test_async_without_a_critic_needs_no_correction_as_miles() -> None:
    # miles' check returns unless use_critic: the critic-free estimators run async with the clipped loss alone
    cfg("--rollout-num-engines", "1", "--async-rollout")


def test_ppo_refuses_reward_level_kl_with_miles_reason() -> None:
    with pytest.raises(ConfigError, match="the critic's value targets would not include the KL penalty"):
        cfg("--rollout-num-engines", "1", "--advantage-estimator", "ppo", "--kl-coef", "0.1")


def test_critic_flags_reach_the_ranks_with_upstream_defaults() -> None:
    settings = train_settings(cfg("--rollout-num-engines", "1", "--advantage-estimator", "ppo", "--lr", "3e-6"))
    assert settings.critic is not None and settings.returns is not None
    assert (settings.critic.lr, settings.critic.value_clip, settings.critic.critic_only_steps) == (3e-6, 0.2, 0)
    assert (settings.returns.estimator, settings.returns.gamma, settings.returns.lambd) == ("ppo", 1.0, 1.0)
    settings = train_settings(cfg("--rollout-num-engines", "1", "--advantage-estimator", "ppo", "--critic-lr", "1e-5",
                   "--gamma", "0.9", "--lambd", "0.95", "--value-clip", "0.5", "--num-critic-only-steps", "2",
                   "--normalize-advantages"))
    assert settings.critic is not None and settings.returns is not None
    assert (settings.critic.lr, settings.critic.value_clip, settings.critic.critic_only_steps) == (1e-5, 0.5, 2)
    assert (settings.returns.gamma, settings.returns.lambd, settings.returns.normalize) == (0.9, 0.95, True)
    # REINFORCE++: per-token returns on the ranks only when discounted; no critic either way
    for gamma, on_ranks in (("1.0", False), ("0.9", True)):
        settings = train_settings(cfg("--rollout-num-engines", "1", "--advantage-estimator", "reinforce_plus_plus",
                       "--normalize-advantages", "--gamma", gamma))
        assert settings.critic is None and (settings.returns is not None) is on_ranks
    assert train_settings(cfg("--rollout-num-engines", "1")).returns is None


def test_eval_allow_partial_fleet_reaches_the_eval_settings() -> None:
    from coordinator.eval.settings import EvalSettings

    flags = ["--rollout-num-engines", "1", "--eval-num-engines", "2", "--eval-interval", "1", "--eval-prompt-data", "d", "builtin:first_digit"]
    for extra, expected in (([], False), (["--eval-allow-partial-fleet"], True)):
        config = parse_config([*BASE, *flags, *extra])
        settings = EvalSettings.from_slices(config.eval, rollout=config.rollout, sglang=config.sglang)
        assert settings.allow_partial_fleet is expected


def test_miles_skip_actor_forward_only_is_what_rayless_does_said_in_the_notice() -> None:
    """miles' flag skips a forward-only pass rayless never runs for a rollout's first step (the trainer reuses the
    step's own forward, `SAME_POLICY`); with one step per rollout it is accepted and said, with LoRA dropout
    refused as miles refuses it."""
    from coordinator.config.porting import porting_notice

    config = cfg("--rollout-num-engines", "1", "--skip-actor-forward-only")
    assert config.train_steps_per_rollout == 1 and train_settings(config).loss.recomputes_old_log_probs
    notice = porting_notice(config)
    assert notice is not None and "--skip-actor-forward-only: no separate old-logprob pass" in notice
    with pytest.raises(ConfigError, match=re.escape("--skip-actor-forward-only with --lora-dropout")):
        cfg("--rollout-num-engines", "1", "--skip-actor-forward-only", "--lora-rank", "4", "--target-modules",
            "all-linear", "--lora-dropout", "0.1")
