"""slime/miles flags with slime's meaning, from the command line to where they act: the optimizer and schedule
built by a real Trainer, `--load` / `--ref-load` on disk, `--save-retain-interval` pruning, the reference model
from our checkpoint, activation checkpointing, hook aliases, Megatron flags parsed with their values, wandb."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from coordinator.checks.preflight import check_checkpoints
from coordinator.config import ConfigError, parse_config
from coordinator.config.aliases import HOOK_ALIASES
from coordinator.config.porting import architecture_disagreements, porting_notice
from coordinator.config.sft import SFT_ROLLOUT_FUNCTION
from coordinator.train.settings import train_settings
from tests.support.train_samples import synthetic_samples
from tests.support.train_settings import flat_view, init_command
from workers import protocol
from workers.train_rank import checkpoint
from workers.train_rank.model import activation_checkpointing_on
from workers.train_rank.trainer import Trainer

torch.set_num_threads(1)


def argv(model: Path, *extra: str) -> list[str]:
    return ["--hf-checkpoint", str(model), "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
            "--num-rollout", "3", "--prompt-data", "builtin:first_digit", "--rollout-num-engines", "1", *extra]


def sft_argv(model: Path, *extra: str) -> list[str]:
    """An SFT run's flags: no engines, one sample per chat."""
    return ["--hf-checkpoint", str(model), "--rollout-batch-size", "2", "--num-rollout", "3", "--prompt-data",
            "builtin:first_digit", "--loss-type", "sft_loss", *extra]


def trainer_for(settings: dict) -> Trainer:
    trainer = Trainer(rank=0, world_size=1, device=torch.device("cpu"))
    trainer.init(init_command(settings))
    return trainer


# --- the optimizer and the schedule reach the trainer ----------------------------------------------------------
def test_adam_flags_reach_the_optimizer(tiny_model_dir: Path) -> None:
    config = parse_config(argv(tiny_model_dir, "--optimizer", "adam", "--adam-beta1", "0.8", "--adam-beta2", "0.98",
                               "--adam-eps", "1e-6", "--weight-decay", "0.1", "--lr", "2e-5"))
    trainer = trainer_for(flat_view(train_settings(config)))
    assert trainer.optimizer is not None
    group = trainer.optimizer.param_groups[0]
    assert group["betas"] == (0.8, 0.98) and group["eps"] == 1e-6 and group["weight_decay"] == 0.1
    assert isinstance(trainer.optimizer, torch.optim.AdamW) and group["lr"] == 2e-5


def test_lr_decay_spans_the_runs_steps_and_gives_slimes_values(tiny_model_dir: Path) -> None:
    # 3 rollouts × 2 steps (4 samples, global batch 2) = 6 optimizer steps; cosine from 1e-3 to 1e-4.
    config = parse_config(argv(tiny_model_dir, "--lr", "1e-3", "--min-lr", "1e-4", "--lr-decay-style", "cosine",
                               "--global-batch-size", "2", "--lr-warmup-iters", "1"))
    settings = flat_view(train_settings(config))
    assert settings["lr_decay_steps"] == 6 and settings["lr_decay_style"] == "cosine"
    trainer = trainer_for(settings)
    samples = synthetic_samples(tiny_model_dir, 2, seed=1)
    tokens = sum(len(s.loss_mask) for s in samples)
    seen = []
    for _ in range(6):
        result = trainer.train(protocol.TrainCommand(0, [samples], [tokens]))
        seen.append(result.steps[0].lr)

    def megatron(step: int) -> float:  # warm-up 1 step from 0, then cosine over steps 1..6
        if step <= 1:
            return 1e-3 * step
        ratio = (step - 1) / (6 - 1)
        return 1e-4 + (1e-3 - 1e-4) * 0.5 * (1 + math.cos(math.pi * ratio))

    assert seen == pytest.approx([megatron(step) for step in range(6)], rel=1e-9)
    # --lr-decay-iters overrides the span.
    assert flat_view(train_settings(parse_config(argv(tiny_model_dir, "--lr-decay-iters", "100"))))["lr_decay_steps"] == 100


def test_num_steps_per_rollout_sets_the_global_batch(tiny_model_dir: Path) -> None:
    config = parse_config(argv(tiny_model_dir, "--num-steps-per-rollout", "2"))
    assert config.effective_global_batch_size == 2 and config.train_steps_per_rollout == 2
    assert flat_view(train_settings(config))["num_steps_per_rollout"] == 2
    with pytest.raises(ConfigError, match="--num-steps-per-rollout 3 does not divide"):
        parse_config(argv(tiny_model_dir, "--num-steps-per-rollout", "3"))


def test_kl_flags_are_slimes(tiny_model_dir: Path) -> None:
    settings = flat_view(train_settings(parse_config(argv(tiny_model_dir, "--use-kl-loss", "--kl-loss-coef", "0.001",
                                 "--kl-loss-type", "low_var_kl"))))
    assert (settings["use_kl_loss"], settings["kl_loss_coef"], settings["kl_loss_type"]) == (True, 0.001,
                                                                                            "low_var_kl")
    with pytest.raises(ConfigError, match="only one of them"):
        parse_config(argv(tiny_model_dir, "--kl-coef", "0.1", "--kl-loss-coef", "0.1"))
    # --kl-coef shapes rewards in slime; under grpo it has no effect there, and the notice says so here.
    config = parse_config(argv(tiny_model_dir, "--kl-coef", "0.1"))
    assert "kl_coef" not in flat_view(train_settings(config))
    assert "--kl-coef 0.1 has no effect on grpo advantages" in (porting_notice(config) or "")
    # ppo trains a critic; reward-level KL with it is refused with miles' reason
    assert train_settings(parse_config(argv(tiny_model_dir, "--advantage-estimator", "ppo"))).critic is not None
    with pytest.raises(ConfigError, match="would not include the KL penalty"):
        parse_config(argv(tiny_model_dir, "--advantage-estimator", "ppo", "--kl-coef", "0.1"))
    with pytest.raises(ConfigError, match="needs --normalize-advantages"):
        parse_config(argv(tiny_model_dir, "--advantage-estimator", "reinforce_plus_plus"))
    assert flat_view(train_settings(parse_config(argv(tiny_model_dir, "--advantage-estimator", "gspo"))))["policy_loss"] == "gspo"


# --- --load, --ref-load, --save-retain-interval ----------------------------------------------------------------
def test_load_of_a_missing_or_empty_directory_starts_fresh(tiny_model_dir: Path, tmp_path: Path) -> None:
    missing = parse_config(argv(tiny_model_dir, "--load", str(tmp_path / "run"), "--save", str(tmp_path / "run")))
    _, plan = check_checkpoints(missing)
    assert not plan.resume and plan.fresh_reason == "does not exist yet"
    (tmp_path / "empty").mkdir()
    assert parse_config(argv(tiny_model_dir, "--load", str(tmp_path / "empty"))).load_plan().fresh_reason == \
        "holds no checkpoint yet"
    assert parse_config(argv(tiny_model_dir, "--load", str(tiny_model_dir))).load_plan().fresh_reason == \
        "is the --hf-checkpoint model"
    (tmp_path / "saved").mkdir()
    (tmp_path / "saved" / "latest").write_text('"rollout_3"')
    plan = parse_config(argv(tiny_model_dir, "--load", str(tmp_path / "saved"))).load_plan()
    assert plan.resume and plan.path == str(tmp_path / "saved")


def test_megatron_checkpoints_are_refused_with_what_to_pass(tiny_model_dir: Path, tmp_path: Path) -> None:
    megatron = tmp_path / "Qwen3-4B_torch_dist"
    (megatron / "iter_0000000").mkdir(parents=True)
    (megatron / "latest_checkpointed_iteration.txt").write_text("release")
    for flags in (["--load", str(megatron)], ["--use-kl-loss", "--ref-load", str(megatron)]):
        with pytest.raises(ConfigError, match=r"Megatron-LM checkpoint \(torch_dist\).*--hf-checkpoint"):
            check_checkpoints(parse_config(argv(tiny_model_dir, *flags)))
    with pytest.raises(ConfigError, match=r"--ref-load .*: no such directory"):
        check_checkpoints(parse_config(argv(tiny_model_dir, "--use-kl-loss", "--ref-load", str(tmp_path / "x"))))
    # Without --use-kl-loss no reference is loaded, so --ref-load is not read (slime checks it only then).
    assert parse_config(argv(tiny_model_dir, "--ref-load", str(tmp_path / "x"))).reference_path() is None


# torch.distributed.checkpoint in one process without a process group (what these tests are) says so in a warning.
SINGLE_PROCESS_DCP = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


@SINGLE_PROCESS_DCP
def test_reference_model_from_our_checkpoint(tiny_model_dir: Path, tmp_path: Path) -> None:
    trained = trainer_for({"model_path": str(tiny_model_dir), "lr": 1e-2, "use_rollout_logprobs": True})
    samples = synthetic_samples(tiny_model_dir, 2, seed=3)
    trained.train(protocol.TrainCommand(0, [samples], [sum(len(s.loss_mask) for s in samples)]))
    trained.save(protocol.SaveCommand(rollout_id=0, directory=str(tmp_path / "ckpt"), extra={}))
    config = parse_config(argv(tiny_model_dir, "--use-kl-loss", "--ref-load", str(tmp_path / "ckpt")))
    settings = flat_view(train_settings(config))
    assert settings["reference_path"] == str(tmp_path / "ckpt")
    reference = trainer_for(settings).reference
    base = trainer_for({"model_path": str(tiny_model_dir), "use_kl_loss": True}).reference
    name, weight = next((n, p) for n, p in trained.model.named_parameters() if "layers.0.mlp" in n)
    assert torch.equal(dict(reference.named_parameters())[name], weight.detach())
    assert not torch.equal(dict(base.named_parameters())[name], weight.detach())


@SINGLE_PROCESS_DCP
def test_save_retain_interval_prunes_as_megatron(tmp_path: Path) -> None:
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)

    def save(directory: Path, rollout_id: int, retain: int | None) -> None:
        checkpoint.save_checkpoint(directory, rollout_id, model=model, optimizer=optimizer, scheduler=scheduler,
                                   extra={}, retain_interval=retain)

    # slime saves after rollouts 19, 39, 59 with --save-interval 20: none is a multiple of 20, so only the
    # latest survives (miles' --save-interval 20 --save-retain-interval 20).
    for rollout_id in (19, 39, 59):
        save(tmp_path / "a", rollout_id, 20)
    assert sorted(p.name for p in (tmp_path / "a").glob("rollout_*")) == ["rollout_59"]
    # With interval 2, ids 2 and 4 are kept when superseded; 1 and 3 are deleted; the latest always stays.
    for rollout_id in (1, 2, 3, 4, 5):
        save(tmp_path / "b", rollout_id, 2)
    assert sorted(p.name for p in (tmp_path / "b").glob("rollout_*")) == ["rollout_2", "rollout_4", "rollout_5"]
    for rollout_id in (1, 2, 3):
        save(tmp_path / "c", rollout_id, None)
    assert len(list((tmp_path / "c").glob("rollout_*"))) == 3


# --- Megatron flags mapped to ours ------------------------------------------------------------------------------
def test_activation_checkpointing_gives_the_same_gradients(tiny_model_dir: Path) -> None:
    config = parse_config(argv(tiny_model_dir, "--recompute-granularity", "full", "--recompute-method",
                               "uniform", "--recompute-num-layers", "1"))
    settings = flat_view(train_settings(config))
    assert settings["gradient_checkpointing"] is True
    samples = synthetic_samples(tiny_model_dir, 2, seed=5)
    tokens = sum(len(s.loss_mask) for s in samples)
    norms = []
    for checkpointing in (True, False):
        trainer = trainer_for({**settings, "gradient_checkpointing": checkpointing})
        assert activation_checkpointing_on(trainer.model) is checkpointing
        result = trainer.train(protocol.TrainCommand(0, [samples], [tokens]))
        norms.append(result.steps[0].grad_norm)
    assert norms[0] == pytest.approx(norms[1], rel=1e-5)


def test_megatron_flags_are_parsed_with_their_values(tiny_model_dir: Path) -> None:
    config = parse_config(argv(tiny_model_dir, "--num-layers", "36", "--swiglu", "--moe-aux-loss-coeff", "0",
                               "--moe-layer-freq", "[0]*1+[1]*46", "--spec", "slime_plugins.models.glm4",
                               "get_glm_spec", "--bf16", "--micro-batch-size", "2", "--attention-backend", "flash",
                               "--tensor-model-parallel-size", "2", "--sequence-parallel"))
    megatron = config.megatron
    assert (megatron.num_layers, megatron.swiglu, megatron.moe_aux_loss_coeff) == (36, True, (0.0,))
    assert megatron.moe_layer_freq == "[0]*1+[1]*46" and megatron.spec == ("slime_plugins.models.glm4",
                                                                           "get_glm_spec")
    settings = flat_view(train_settings(config))
    assert settings["compute_dtype"] == "bfloat16" and settings["micro_batch_size"] == 2
    with pytest.raises(ConfigError, match="--attention-backend: 'fast' is not a valid choice"):
        parse_config(argv(tiny_model_dir, "--attention-backend", "fast"))
    with pytest.raises(ConfigError, match="--num-layers: expected an integer"):
        parse_config(argv(tiny_model_dir, "--num-layers", "many"))
    # A switch takes no value: the next token is not swallowed.
    with pytest.raises(ConfigError, match=r"unrecognised arguments|values without a flag"):
        parse_config(argv(tiny_model_dir, "--swiglu", "yes"))
    # --use-dynamic-batch-size makes --micro-batch-size moot, as in slime.
    assert flat_view(train_settings(parse_config(argv(tiny_model_dir, "--micro-batch-size", "2", "--use-dynamic-batch-size")
                        )))["micro_batch_size"] is None


def test_disagreements_with_config_json_are_named(tiny_model_dir: Path) -> None:
    model = json.loads((tiny_model_dir / "config.json").read_text())
    config = parse_config(argv(tiny_model_dir, "--num-layers", str(model["num_hidden_layers"]), "--hidden-size",
                               "4096", "--seq-length", "999999"))
    given = {"num_layers": model["num_hidden_layers"], "hidden_size": 4096, "seq_length": 999999}
    found = architecture_disagreements(config, given)
    assert found[0] == f"--hidden-size 4096 ≠ hidden_size {model['hidden_size']}"
    assert found[1].startswith("--seq-length 999999 > the context length") and len(found) == 2


def test_slime_and_miles_hook_paths_resolve_to_ours(tiny_model_dir: Path) -> None:
    # miles' multi-turn generate needs its settings (each a module path; validation does not import them)
    multi_turn = ["--generate-tool-specs-path", "m.specs", "--generate-execute-tool-function-path", "m.run",
                  "--generate-tool-call-parser", "qwen25"]
    # miles' agentic generate needs its agent and the session server
    agentic = ["--custom-agent-function-path", "m.run_agent", "--use-session-server"]
    # on-policy distillation's teacher hooks are the teacher at --rm-url of --use-opd --opd-type sglang
    distill = ["--use-opd", "--opd-type", "sglang", "--rm-url", "http://127.0.0.1:30001/generate"]
    for (field, theirs), alias in HOOK_ALIASES.items():
        extra = multi_turn if field == "custom_generate_function_path" else []
        extra = agentic if theirs.endswith("agentic_tool_call.generate") else extra
        extra = distill if ".on_policy_distillation." in theirs else extra
        make = sft_argv if alias.ours == SFT_ROLLOUT_FUNCTION else argv
        config = parse_config(make(tiny_model_dir, "--" + field.replace("_", "-"), theirs, *extra))
        slice_ = config.hooks if field == "custom_generate_function_path" else config.rollout
        assert getattr(slice_, field) == alias.ours
        assert config.rollout.async_rollout is alias.async_rollout
        assert f"{theirs} → {alias.ours}" in (porting_notice(config) or "")
    assert parse_config(argv(tiny_model_dir, "--fully-async")).rollout.async_rollout


def test_wandb_flags_are_slimes(tiny_model_dir: Path) -> None:
    config = parse_config(argv(tiny_model_dir, "--use-wandb", "--wandb-project", "p", "--wandb-team", "t",
                               "--wandb-group", "g", "--wandb-host", "https://w.example", "--wandb-key", "k3y"))
    assert config.logging.wandb_init_kwargs(suffix="abc123") == {"project": "p", "entity": "t", "group": "g",
                                                                  "name": "g_abc123"}
    assert config.logging.wandb_login_kwargs() == {"key": "k3y", "host": "https://w.example"}
    fixed = parse_config(argv(tiny_model_dir, "--wandb-group", "g", "--disable-wandb-random-suffix"))
    assert fixed.logging.wandb_init_kwargs(suffix="abc123")["name"] == "g"
    assert "k3y" not in config.to_json()


def test_router_address_and_broadcast_mode(tiny_model_dir: Path) -> None:
    config = parse_config(argv(tiny_model_dir, "--sglang-router-ip", "10.0.0.2", "--sglang-router-port", "3001",
                               "--update-weight-transfer-mode", "broadcast"))
    assert config.sglang.router_address == "10.0.0.2:3001"
    assert config.sglang.update_weight_transfer_mode == "broadcast"
    with pytest.raises(ConfigError, match="--sglang-router-ip names a running router: give its "
                                          "--sglang-router-port too"):
        parse_config(argv(tiny_model_dir, "--sglang-router-ip", "10.0.0.2"))


def test_sglang_router_port_alone_launches_the_router_on_that_port(tiny_model_dir: Path) -> None:
    """miles' start_router: no --sglang-router-ip, so the router is launched, on --sglang-router-port."""
    from coordinator.plan import GpuInventory, build_plan

    config = parse_config(argv(tiny_model_dir, "--sglang-router-port", "34567"))
    assert config.sglang.launches_router and config.sglang.router_address is None
    plan = build_plan(config, GpuInventory.of_count(0, "injected", injected=True), has_sglang=False)
    assert plan.local.router is not None and plan.local.router.port == 34567
    attached = parse_config(argv(tiny_model_dir, "--sglang-router-ip", "10.0.0.2", "--sglang-router-port", "3001"))
    assert not attached.sglang.launches_router
    assert build_plan(attached, GpuInventory.of_count(0, "injected", injected=True),
                      has_sglang=False).local.router is None


def test_miles_dump_details_dumps_every_rollout_under_its_directory(tiny_model_dir: Path, tmp_path: Path) -> None:
    config = parse_config(argv(tiny_model_dir, "--dump-details", str(tmp_path / "details")))
    template = config.debug.save_debug_rollout_data
    assert template == str(tmp_path / "details" / "rollout_data" / "{rollout_id}.rld")
    notice = porting_notice(config) or ""
    assert f"--dump-details → rollouts dumped to {template}" in notice and "not written" in notice
    with pytest.raises(ConfigError, match="--dump-details and --save-debug-rollout-data"):
        parse_config(argv(tiny_model_dir, "--dump-details", str(tmp_path), "--save-debug-rollout-data",
                          str(tmp_path / "{rollout_id}.rld")))
