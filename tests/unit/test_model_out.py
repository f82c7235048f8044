"""The line a finished run ends with: where its trained model lies (`coordinator.lifecycle.model_out`)."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from coordinator.config import Config, parse_config
from coordinator.lifecycle.model_out import model_hint


def config_with(model: Path, *extra: str) -> Config:
    return parse_config(["--hf-checkpoint", str(model), "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
                         "--num-rollout", "20", "--prompt-data", "builtin:first_digit", "--rollout-num-engines", "1",
                         *extra])


def test_save_hf_names_the_last_saved_models_directory(tiny_model_dir: Path, tmp_path: Path) -> None:
    config = config_with(tiny_model_dir, "--save", str(tmp_path / "ckpt"),
                         "--save-hf", str(tmp_path / "hf" / "{rollout_id}"))
    hint = model_hint(config, [9, 19])
    assert hint is not None and hint.startswith(f"the model of rollout 19: {tmp_path / 'hf' / '19'} (")


def test_a_checkpoint_alone_comes_with_an_export_command_a_shell_takes(tiny_model_dir: Path, tmp_path: Path) -> None:
    save = tmp_path / "my runs" / "ckpt"  # a space: the command is quoted for a shell
    hint = model_hint(config_with(tiny_model_dir, "--save", str(save)), [4])
    assert hint is not None and hint.startswith(f"the checkpoint of rollout 4: {save / 'rollout_4'}; ")
    command = shlex.split(hint.split("directory: ", 1)[1])
    assert command == ["rayless", "export", str(save), str(tmp_path / "my runs" / "model")]


def test_relative_paths_are_said_absolute(tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                          ) -> None:
    """`./run.sh` runs the job from the repository: a relative --save is the repository's, not the caller's."""
    monkeypatch.chdir(tmp_path)
    hint = model_hint(config_with(tiny_model_dir, "--save", "runs/x/ckpt"), [15])
    assert hint is not None
    assert shlex.split(hint.split("directory: ", 1)[1])[2:] == [str(tmp_path / "runs/x/ckpt"),
                                                                str(tmp_path / "runs/x/model")]
    hint = model_hint(config_with(tiny_model_dir, "--save-hf", "hf/{rollout_id}"), [15])
    assert hint is not None and f": {tmp_path / 'hf' / '15'} (" in hint


def test_nothing_saved_says_nothing(tiny_model_dir: Path, tmp_path: Path) -> None:
    assert model_hint(config_with(tiny_model_dir, "--save", str(tmp_path / "ckpt")), []) is None
    assert model_hint(config_with(tiny_model_dir), [3]) is None
