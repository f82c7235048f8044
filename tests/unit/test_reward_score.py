"""`rayless reward score`: one reward per row, `--compare` listing where two graders differ, clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from coordinator.cli import main

ROWS = [
    {"response": r"We add them: $\boxed{2+3}$.", "label": "5"},
    {"response": r"So the answer is $\boxed{5}$.", "label": "5"},
    {"response": r"Half of it: $\boxed{\frac{2}{4}}$", "label": r"\frac{1}{2}"},
    {"response": r"It is $\boxed{0.5}$", "label": r"\frac{1}{2}"},
]


def _write(path: Path, rows: list[object]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def _lines(text: str) -> list[dict[str, object]]:
    return [json.loads(line) for line in text.splitlines()]


def test_score_writes_one_reward_per_row(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = _write(tmp_path / "a.jsonl", ROWS)
    assert main(["reward", "score", "--rm-type", "math", str(data)]) == 0
    captured = capsys.readouterr()
    assert _lines(captured.out) == [{"index": 0, "reward": 0.0}, {"index": 1, "reward": 1.0},
                                    {"index": 2, "reward": 0.0}, {"index": 3, "reward": 1.0}]
    assert "4 rows scored with math" in captured.err
    out = tmp_path / "rewards.jsonl"
    assert main(["reward", "score", "--rm-type", "math_lenient", "--out", str(out), str(data)]) == 0
    assert [row["reward"] for row in _lines(out.read_text())] == [1.0, 1.0, 1.0, 1.0]


def test_compare_prints_where_two_graders_differ(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = _write(tmp_path / "a.jsonl", ROWS)
    out = tmp_path / "both.jsonl"
    assert main(["reward", "score", "--rm-type", "math", "--compare", "math_lenient", "--out", str(out),
                 str(data)]) == 0
    report = capsys.readouterr().out.splitlines()
    assert report[0].startswith("line 1: math=0.0 math_lenient=1.0") and "2+3" in report[0]
    assert report[1].startswith("line 3: math=0.0 math_lenient=1.0")
    assert report[2] == "math and math_lenient differ on 2 of 4 rows" and len(report) == 3
    assert _lines(out.read_text())[0] == {"index": 0, "reward": 0.0, "compare": 1.0}


def test_keys_and_dict_rewards(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rows = [{"text": "Answer: 34", "gold": 34, "info": {}}, {"text": "Answer: 35", "gold": 34, "info": {}}]
    data = _write(tmp_path / "d.jsonl", rows)
    flags = ["--input-key", "text", "--label-key", "gold", "--metadata-key", "info"]
    assert main(["reward", "score", "--rm-type", "dapo", *flags, str(data)]) == 0
    assert _lines(capsys.readouterr().out)[1] == {"index": 1, "reward": {"score": -1.0, "acc": 0.0}}
    assert main(["reward", "score", "--rm-type", "dapo", "--compare", "boxed_dapo", "--reward-key", "acc", *flags,
                 str(data)]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "dapo and boxed_dapo differ on 1 of 2 rows"


def test_bad_rows_are_reported_and_exit_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = tmp_path / "bad.jsonl"
    data.write_text('{"response": "Answer: 3", "label": "three"}\nnot json\n[1]\n{"label": "3"}\n'
                    '{"response": "Answer: 3", "label": "3"}\n', encoding="utf-8")
    assert main(["reward", "score", "--rm-type", "dapo", str(data)]) == 1
    captured = capsys.readouterr()
    assert "rayless reward score: 1 row scored with dapo, 4 could not be" in captured.err
    lines = _lines(captured.out)
    assert "needs an integer label" in str(lines[0]["error"])
    assert "line 2 is not JSON" in str(lines[1]["error"]) and "not an object" in str(lines[2]["error"])
    assert "no text field 'response' (--input-key)" in str(lines[3]["error"])
    assert lines[4] == {"index": 4, "reward": {"score": 1.0, "acc": 1.0}}


def test_a_row_counts_once_when_both_graders_fail(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = _write(tmp_path / "c.jsonl", [{"response": "Answer: 3", "label": "three"},
                                         {"response": "Answer: 3", "label": "3"}])
    assert main(["reward", "score", "--rm-type", "dapo", "--compare", "boxed_dapo", str(data)]) == 1
    assert "1 row scored with dapo and boxed_dapo, 1 could not be" in capsys.readouterr().err


def test_gpqa_index_labels_grade_as_in_a_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A choice-index label (JSON `1`) is the index to gpqa, as slime passes it: "The answer is B" scores 1.0,
    and the same rows read by the run's prompt source and scored by the run's reward router score the same."""
    import anyio

    from coordinator.data.source import read_prompt_file
    from coordinator.rollout.requests import new_sample
    from coordinator.rollout.rewards import RewardModel

    choices = {"metadata": {"choices": ["red", "blue", "green", "2 apples"]}}
    rows = [{"prompt": "q", "response": "The answer is B", "label": 1, **choices},
            {"prompt": "q", "response": "The answer is B", "label": 2, **choices},
            {"prompt": "q", "response": "I have 2 apples, so A", "label": 2, **choices}]
    data = _write(tmp_path / "gpqa.jsonl", rows)
    assert main(["reward", "score", "--rm-type", "gpqa", str(data)]) == 0
    scored = [row["reward"] for row in _lines(capsys.readouterr().out)]
    assert scored == [1.0, 0.0, 0.0]

    records = read_prompt_file(data, label_key="label", metadata_key="metadata")
    assert [type(record.label) for record in records] == [int, int, int]
    samples = [new_sample(record, [1, 2], 0, index) for index, record in enumerate(records)]
    for sample, row in zip(samples, rows, strict=True):
        sample.response, sample.status = row["response"], sample.status.COMPLETED
    anyio.run(RewardModel(rm_type="gpqa").score_group, samples)
    assert [sample.reward for sample in samples] == scored


@pytest.mark.parametrize(("argv", "message"), [
    (["--rm-type", "mathh"], "--rm-type: rm-type 'mathh' is not a built-in reward; known: char_match"),
    (["--rm-type", "math", "--compare", "remote_rm"], "--compare remote_rm is scored by a running service"),
])
def test_bad_flags_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str],
                          message: str) -> None:
    data = _write(tmp_path / "a.jsonl", ROWS)
    assert main(["reward", "score", *argv, str(data)]) == 2
    captured = capsys.readouterr()
    assert message in captured.err and captured.out == ""


def test_missing_file_and_subcommand_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["reward", "score", "--rm-type", "math", str(tmp_path / "nope.jsonl")]) == 2
    assert "nope.jsonl: no such file" in capsys.readouterr().err
    assert main(["reward"]) == 2
    assert main(["reward", "score"]) == 2  # argparse: --rm-type and FILE are required
    assert "required" in capsys.readouterr().err


def test_the_docs_show_real_output(capsys: pytest.CaptureFixture[str]) -> None:
    """docs/rewards.md's listings are what the command prints on docs/rewards_example.jsonl."""
    pytest.importorskip("math_verify", reason="Math-Verify is the math-verify extra (in dev)")
    docs = Path(__file__).resolve().parents[2] / "docs"
    page = docs.joinpath("rewards.md").read_text(encoding="utf-8")
    for flags in (["--rm-type", "math"], ["--rm-type", "math", "--compare", "math_verify"],
                  ["--rm-type", "deepscaler", "--compare", "math"]):
        assert main(["reward", "score", *flags, str(docs / "rewards_example.jsonl")]) == 0
        shown = f"$ rayless reward score {' '.join(flags)} rewards_example.jsonl\n{capsys.readouterr().out}"
        assert shown in page


def test_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["reward", "--help"]) == 0
    assert "rayless reward score --rm-type T" in capsys.readouterr().out
    assert main(["reward", "score", "--help"]) == 0
    assert "--compare T2" in capsys.readouterr().out


def test_score_shows_its_progress_and_rate_as_it_streams(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Progress lines (rows done, rows/s) while scoring — every 1,024 rows here, the interval set to 0 — and the
    whole run's rate at the end; every row's reward written as it is scored."""
    from coordinator.rewards import score

    monkeypatch.setattr(score, "LOG_EVERY_S", 0.0)
    data = _write(tmp_path / "many.jsonl", [{"response": str(i % 3), "label": "1"} for i in range(3000)])
    out = tmp_path / "rewards.jsonl"
    assert main(["reward", "score", "--rm-type", "exact_match", "--out", str(out), str(data)]) == 0
    err = capsys.readouterr().err.splitlines()
    progress = [line for line in err if "rows/s" in line and " in " not in line]
    assert [line.split(": ")[1].split(" rows")[0] for line in progress] == ["1,024", "2,048"], err
    assert err[-1].startswith("rayless reward score: 3000 rows scored with exact_match in ") and "rows/s)" in err[-1]
    assert sum(row["reward"] for row in _lines(out.read_text())) == 1000
