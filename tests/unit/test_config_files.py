"""Config files at the boundary: YAML without anchors or aliases, and null refused for every flag taking a number
or text (found from the flags' own types, so a flag added later is covered too)."""

from __future__ import annotations

from pathlib import Path

import pytest

from coordinator.config import FLAGS, ConfigError, parse_config, parse_config_mapping
from coordinator.config.eval_file import read_eval_config
from tests.support.hostile_files import laughs

SCALAR_FLAGS = sorted(name for name, (_, spec) in FLAGS.items()
                      if spec.container is None and spec.kind in (int, float, str))
BASE = ["--hf-checkpoint", "/model", "--rollout-batch-size", "4", "--n-samples-per-prompt", "2",
        "--num-rollout", "3", "--prompt-data", "builtin:first_digit", "--rollout-num-engines", "1"]


def test_every_flag_taking_a_number_or_text_refuses_null_naming_the_key() -> None:
    assert {"num_layers", "hidden_size", "seq_length", "lr", "rollout_batch_size"} <= set(SCALAR_FLAGS)
    unrefused = []
    for name in SCALAR_FLAGS:
        key = name.replace("_", "-")
        try:
            parse_config_mapping({key: None}, origin="--config job.yaml")
        except ConfigError as error:
            if f"--config job.yaml: key '{key}': null is not a value for --{key}" not in str(error):
                unrefused.append(f"{key}: {error}")
        else:
            unrefused.append(f"{key}: accepted")
    assert not unrefused, unrefused


def test_null_keeps_its_meaning_for_switches_and_lists() -> None:
    optional_switch = next(name for name, (_, spec) in FLAGS.items() if spec.kind is bool and spec.optional)
    optional_list = next(name for name, (_, spec) in FLAGS.items() if spec.container is not None and spec.optional)
    for name in (optional_switch, optional_list):
        try:
            parse_config_mapping({name: None}, origin="job.yaml")
        except ConfigError as error:
            assert "null is not a value" not in str(error)


@pytest.mark.parametrize("flag", ["--config", "--custom-config-path", "--eval-config"])
def test_a_billion_laughs_is_refused_at_its_first_anchor_naming_file_and_line(tmp_path: Path, flag: str) -> None:
    path = tmp_path / "job.yaml"
    path.write_text("# a comment first\n" + laughs())
    argv = [*BASE, flag, str(path)] + (["--eval-interval", "1"] if flag == "--eval-config" else [])
    with pytest.raises(ConfigError) as error:
        parse_config(argv)
    assert str(error.value) == f"{flag} {path}:2: anchors and aliases are not accepted (&/* in YAML)"


def test_an_alias_alone_is_refused_too_and_plain_yaml_still_reads(tmp_path: Path) -> None:
    path = tmp_path / "eval.yaml"
    path.write_text("defaults: {n_samples_per_eval_prompt: 2}\ndatasets:\n  - {name: a, path: builtin:copy}\n")
    assert [spec.name for spec in read_eval_config(str(path))] == ["a"]
    path.write_text("datasets:\n  - {name: a, path: builtin:copy}\n  - *x\n")
    with pytest.raises(ConfigError, match=f"^--eval-config {path}:3: anchors and aliases"):
        read_eval_config(str(path))


@pytest.mark.parametrize("key", ["apply-chat-template-kwargs", "train-env-vars"])
def test_a_json_valued_flag_nested_50k_deep_is_one_error_not_a_recursion_error(key: str) -> None:
    with pytest.raises(ConfigError, match=f"key '{key}': .* is not JSON: JSON nested deeper than 64 levels"):
        parse_config_mapping({key: "[" * 50_000 + "]" * 50_000}, origin="--config job.yaml")
