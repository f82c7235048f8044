"""`--megatron-config-path` (slime's per-role YAML): the actor's keys that are flags here set them over the
command line, Megatron-only keys are accepted and named, placement keys ignored as slime ignores them, a critic
entry read only in a run with a critic, and what cannot be honoured refused naming the file, role and key."""

from __future__ import annotations

from pathlib import Path

import pytest

from coordinator.config import ConfigError, parse_config
from coordinator.config.porting import porting_notice

BASE = ["--hf-checkpoint", "/m", "--rollout-batch-size", "8", "--num-rollout", "2", "--prompt-data",
        "builtin:first_digit", "--rollout-num-engines", "1", "--lr", "1e-6"]

#: slime docs/en/advanced/megatron-config.md@624b824 (PPO actor/critic), with actor keys rayless honours
PPO_ROLES = """\
megatron:
  - name: default
    role: actor
    overrides:
      lr: 2e-6
      weight_decay: 0.05
      global_batch_size: 4
      tensor_model_parallel_size: 2
      num_gpus_per_node: 4
  - name: default
    role: critic
    overrides:
      lr: 1e-5
"""


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "megatron.yaml"
    path.write_text(text)
    return str(path)


def test_actor_overrides_win_over_the_command_line_and_the_notice_says_what_each_key_did(tmp_path: Path) -> None:
    path = write(tmp_path, PPO_ROLES)
    config = parse_config([*BASE, "--global-batch-size", "8", "--megatron-config-path", path])
    # slime coerces "2e-6" (a YAML string) to the flag's type; the YAML wins over --lr / --global-batch-size
    assert config.train.lr == pytest.approx(2e-6) and config.train.weight_decay == pytest.approx(0.05)
    assert config.train.global_batch_size == 4
    assert config.megatron.tensor_model_parallel_size == 2
    notice = porting_notice(config) or ""
    assert f"--megatron-config-path {path}: sets --lr (actor) --weight-decay (actor) --global-batch-size (actor)" \
        in notice
    assert "actor.tensor_model_parallel_size" in notice and "--tensor-model-parallel-size" in notice
    assert "ignored as slime ignores them (placement follows the command line): actor.num_gpus_per_node" in notice
    assert "its critic entry is not read: this run trains no critic" in notice


def test_a_critic_entry_sets_the_critic_flags_in_a_ppo_run(tmp_path: Path) -> None:
    path = write(tmp_path, "megatron:\n  - {role: critic, overrides: {lr: 1e-5}}\n")
    config = parse_config([*BASE, "--advantage-estimator", "ppo", "--megatron-config-path", path])
    assert config.critic.critic_lr == pytest.approx(1e-5) and config.train.lr == pytest.approx(1e-6)


def test_values_meet_the_flags_checks(tmp_path: Path) -> None:
    path = write(tmp_path, "megatron:\n  - {role: actor, overrides: {lr: -1}}\n")
    with pytest.raises(ConfigError, match=r"--megatron-config-path .*: role actor: lr"):
        parse_config([*BASE, "--megatron-config-path", path])


@pytest.mark.parametrize(("text", "flags", "match"), [
    ("megatron:\n  - {role: actor, overrides: {not_an_argument_anywhere: 1}}\n", (),
     r"role actor: not_an_argument_anywhere: no slime/miles/Megatron-LM argument of that name"),
    ("megatron:\n  - {role: actor, overrides: {enable_mtp_training: true}}\n", (),
     r"role actor: enable_mtp_training: sets --enable-mtp-training, which rayless refuses: "),
    ("megatron:\n  - {role: reward, overrides: {}}\n", (), r"megatron\[0\].role: must be actor or critic"),
    ("megatron:\n  - {role: actor}\n  - {role: actor}\n", (), r"megatron\[1\]: a second entry with role=actor"),
    ("megatron:\n  - {role: actor, extra: 1}\n", (), r"megatron\[0\].extra: not a key of slime's role entries"),
    ("actor: {lr: 1}\n", (), r"must contain a top-level 'megatron' list"),
])
def test_what_cannot_be_honoured_is_refused_by_key(tmp_path: Path, text: str, flags: tuple[str, ...],
                                                   match: str) -> None:
    with pytest.raises(ConfigError, match=match) as caught:
        parse_config([*BASE, "--megatron-config-path", write(tmp_path, text), *flags])
    assert "unknown" not in str(caught.value)


def test_a_missing_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"--megatron-config-path .*absent.yaml: no such file"):
        parse_config([*BASE, "--megatron-config-path", str(tmp_path / "absent.yaml")])
