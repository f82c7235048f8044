"""`workers.engine.args.model_path_problem`: a local --model-path that cannot hold a model is refused before the
engine imports torch; a hub id is left to the loader."""

from __future__ import annotations

from pathlib import Path

from workers.engine.args import model_path_problem


def test_a_model_directory_passes_and_a_hub_id_is_left_to_the_loader(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    assert model_path_problem(str(tmp_path)) is None
    assert model_path_problem("Qwen/Qwen3-0.6B") is None


def test_local_paths_that_hold_no_model_are_named(tmp_path: Path) -> None:
    assert model_path_problem(str(tmp_path)) == "no config.json in that directory"
    assert model_path_problem(str(tmp_path / "missing")) == "no such directory"
    assert model_path_problem("./missing-model-dir") == "no such directory"
    (tmp_path / "weights.bin").write_bytes(b"")
    assert model_path_problem(str(tmp_path / "weights.bin")) == "not a directory"
