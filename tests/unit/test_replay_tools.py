"""`rayless dump show | verify | convert`: output and exit codes, in-process (as a real subprocess: the
integration test test_replay_cli.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from replay.reader import read_dump
from replay.sample import SampleStatus
from replay.tools import main
from tests.support.replay_inputs import write_sample_dump


def test_show_prints_header_counts_and_statistics(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_sample_dump(tmp_path / "11.rld")
    assert main(["show", str(path), "--first", "1"]) == 0
    out = capsys.readouterr().out
    assert "rollout_id" in out and "11" in out
    assert "config.hf_checkpoint" in out and "/models/tiny" in out
    assert "groups: 3  samples: 6  group sizes: 2×3" in out
    assert "status: completed 3, truncated 3" in out
    reward_row = next(line for line in out.splitlines() if "│ reward " in line)
    assert [cell.strip() for cell in reward_row.strip("│ ").split("│")] == [
        "reward",
        "6",
        "0.5",
        "0.5",
        "0",
        "1",
    ]
    assert out.count("sample 0/0") == 1 and "sample 0/1" not in out  # --first 1


def test_show_lists_a_mapping_of_the_header_one_row_per_entry(tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """The training flags a replay takes (and the rollout's metrics) each on a row of their own."""
    from replay.format import write_dump

    dumped = read_dump(write_sample_dump(tmp_path / "1.rld"))
    path = write_dump(tmp_path / "2.rld", 2, dumped.samples,
                      config_facts={"train_flags": {"lr": 0.003, "target_modules": ["q_proj", "v_proj"]}})
    assert main(["show", str(path)]) == 0
    rows = [" ".join(line.strip("│ ").split()) for line in capsys.readouterr().out.splitlines()]
    assert "config.train_flags.lr │ 0.003" in rows
    assert "config.train_flags.target_modules │ ['q_proj', 'v_proj']" in rows


def test_show_decodes_with_a_tokenizer(
    tmp_path: Path, tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    ids = tokenizer.encode("hello", add_special_tokens=False)
    path = write_sample_dump(tmp_path / "11.rld", response_tokens=ids)
    assert main(["show", str(path), "--tokenizer", str(tiny_model_dir), "--first", "1"]) == 0
    assert "decoded response: hello" in capsys.readouterr().out


def test_verify_exit_codes_and_messages(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = write_sample_dump(tmp_path / "1.rld")
    other = write_sample_dump(tmp_path / "2.rld")
    assert main(["verify", str(good), str(other)]) == 0
    out = capsys.readouterr().out
    assert f"ok {good} (rollout 11, 6 samples)" in out and f"ok {other}" in out

    data = bytearray(other.read_bytes())
    data[len(data) // 2] ^= 0x04
    other.write_bytes(bytes(data))
    truncated = tmp_path / "3.rld"
    truncated.write_bytes(good.read_bytes()[:-5])
    assert main(["verify", str(good), str(other), str(truncated), str(tmp_path)]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(f"ok {good}")
    assert lines[1].startswith(f"CORRUPT {other}: checksum mismatch")
    assert lines[2].startswith(f"CORRUPT {truncated}: truncated")
    assert lines[3] == f"CORRUPT {tmp_path}: is a directory, not a dump file"
    assert lines[4] == "3 of 4 file(s) corrupt"


def test_show_on_a_corrupt_file_fails(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "x.rld"
    bad.write_bytes(b"")
    assert main(["show", str(bad)]) == 1
    assert "empty file" in capsys.readouterr().err


def test_convert(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "rollout_0.pt"
    raw = {
        "index": 0,
        "tokens": torch.tensor([1, 2, 3]),
        "response_length": 1,
        "rollout_log_probs": [-0.75],
        "status": "truncated",
        "reward": 0.0,
    }
    torch.save({"rollout_id": 0, "samples": [raw]}, src)
    dst = tmp_path / "0.rld"
    assert main(["convert", str(src), str(dst)]) == 1  # no group_index and no --n-samples-per-prompt
    assert "pass --n-samples-per-prompt" in capsys.readouterr().err
    assert main(["convert", str(src), str(dst), "--n-samples-per-prompt", "1"]) == 0
    assert f"wrote {dst} (rollout 0, 1 samples)" in capsys.readouterr().out
    sample = read_dump(dst).samples[0]
    assert sample.status is SampleStatus.TRUNCATED and sample.rollout_log_probs == [-0.75]
