"""Hostile data, config and dump files through the real `rayless` CLI, in a child process: each is one error
line naming the file (and line), exit 2 for `rayless train` before anything is launched (no child process, the
launcher never imported), the dump tool's own exit 1 for dumps, no traceback, within bounded memory.

The cases of one command run in one child (the CLI's `main`, as the `rayless` script calls it), each with the
kernel's peak-RSS counter reset before it, so each case's memory growth is its own.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from replay.format import write_dump
from replay.sample import Sample, SampleStatus
from tests.support.hostile_dumps import BAD_BUILDS, torch_zip
from tests.support.hostile_files import laughs

MAX_GROWTH_MIB = 256  # the bound on what refusing one hostile input may cost

PROBE = textwrap.dedent(
    """
    import contextlib, io, json, sys, psutil
    from pathlib import Path
    from coordinator.cli import main

    def kib(key):
        line = next(l for l in Path("/proc/self/status").read_text().splitlines() if l.startswith(key + ":"))
        return int(line.split()[1])

    results = []
    for argv in json.loads(sys.stdin.read()):
        out, err = io.StringIO(), io.StringIO()
        Path("/proc/self/clear_refs").write_text("5")
        start = kib("VmRSS")
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                status = main(argv)
            except SystemExit as exit:
                status = exit.code
        results.append({
            "status": status, "stdout": out.getvalue(), "stderr": err.getvalue(),
            "growth_mib": (kib("VmHWM") - start) / 1024,
            "children": len(psutil.Process().children(recursive=True)),
            "launcher_imported": "coordinator.run" in sys.modules,
        })
    print(json.dumps(results))
    """
)


def run_batch(cases: list[list[str]]) -> list[dict[str, Any]]:
    done = subprocess.run([sys.executable, "-c", PROBE], input=json.dumps(cases), capture_output=True, text=True,
                          timeout=180, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def lines(count: int) -> list[bytes]:
    return [json.dumps({"question": f"{i % 10} 7 1=", "answer": str(i % 10)}).encode() for i in range(count)]


def data_file(path: Path, body: list[bytes]) -> Path:
    path.write_bytes(b"".join(line + b"\n" for line in body))
    return path


@pytest.fixture
def job(tiny_model_dir: Path, tmp_path: Path) -> list[str]:
    """A job that would launch an engine and training ranks if its files passed the checks."""
    return ["train", "--hf-checkpoint", str(tiny_model_dir), "--input-key", "question", "--label-key", "answer",
            "--rm-type", "first_digit", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
            "--num-rollout", "1", "--rollout-num-engines", "1", "--run-dir", str(tmp_path / "run")]


def test_bad_data_and_config_files_exit_2_naming_file_and_line_before_launch(job: list[str], tmp_path: Path) -> None:
    good = data_file(tmp_path / "good.jsonl", lines(1000))
    one_bad = data_file(tmp_path / "one_bad.jsonl", [*lines(617), b'{"question": 618, "answer": "8"}', *lines(382)])
    deep = data_file(tmp_path / "deep.jsonl", [*lines(2), b'{"question": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"])
    not_utf8 = data_file(tmp_path / "latin1.jsonl", [lines(1)[0], b'{"question": "caf\xe9", "answer": "1"}'])
    huge_line = b'{"question": "' + b"7" * 5_000_000 + b'", "answer": "7"}'
    huge = data_file(tmp_path / "huge.jsonl", [huge_line])
    bomb = tmp_path / "laughs.yaml"
    bomb.write_text(laughs())
    null = tmp_path / "null.yaml"
    null.write_text("hidden-size: 64\nnum-layers: null\n")
    with_good = [*job, "--prompt-data", str(good)]
    cases: list[tuple[list[str], list[str]]] = [
        ([*with_good, "--config", str(bomb)], [f"--config {bomb}:1: anchors and aliases are not accepted"]),
        ([*with_good, "--eval-config", str(bomb), "--eval-interval", "1"],
         [f"--eval-config {bomb}:1: anchors and aliases are not accepted"]),
        ([*with_good, "--config", str(null)], [f"--config {null}: key 'num-layers': null is not a value"]),
        ([*job, "--prompt-data", str(deep)], [f"--prompt-data: {deep}:3: JSON nested deeper than"]),
        ([*job, "--prompt-data", str(not_utf8)], [f"{not_utf8}:2: not UTF-8 text"]),
        ([*job, "--prompt-data", str(huge)],
         [f"{huge}:1: a line of {len(huge_line) + 1} bytes is over the limit of 1048576 bytes", "--data-max-line-bytes"]),
        ([*job, "--prompt-data", str(one_bad)], [f"{one_bad}:618: input key 'question' holds int"]),
        ([*with_good, "--eval-prompt-data", "held_out", str(one_bad), "--eval-interval", "1"],
         [f"--eval-prompt-data held_out: {one_bad}:618:"]),
        ([*job, "--prompt-data", str(one_bad), "--dry-run"], [f"{one_bad}:618:"]),
    ]
    # the control first: the dry run's imports (the tokenizer's) then count against it, not the refusals
    control, *outcomes = run_batch([[*with_good, "--dry-run"]] + [argv for argv, _ in cases])
    assert control["status"] == 0, control["stderr"][-2000:]  # every check passes: the refusals are the files'
    assert f"--prompt-data {good}: all 1000 record(s) hold input key 'question'" in control["stdout"]
    for (argv, named), outcome in zip(cases, outcomes, strict=True):
        assert outcome["status"] == 2, (argv[-2:], outcome["stderr"][-2000:])
        errors = [line for line in outcome["stderr"].splitlines() if line.startswith("rayless train: error: ")]
        assert len(errors) == 1 and "Traceback" not in outcome["stderr"], outcome["stderr"][-2000:]
        for text in named:
            assert text in errors[0], (text, errors[0])
        assert outcome["children"] == 0 and not outcome["launcher_imported"], argv[-2:]
        assert outcome["growth_mib"] < MAX_GROWTH_MIB, (argv[-2:], outcome["growth_mib"])


def sample(**change: Any) -> Sample:
    base = Sample(group_index=0, sample_index=0, prompt="p", tokens=[5, 6, 7], response_length=2, loss_mask=[1, 1],
                  rollout_log_probs=[-0.5, -0.25], reward=1.0, status=SampleStatus.COMPLETED, weight_versions=["0"])
    return dataclasses.replace(base, **change)


def test_hostile_dumps_and_pt_imports_are_one_error_naming_the_file(tmp_path: Path) -> None:
    set_build = torch_zip(tmp_path / "set.pt", BAD_BUILDS["set of a list"])
    ordered_build = torch_zip(tmp_path / "ordered.pt", BAD_BUILDS["OrderedDict of an int"])
    dumps = {}
    for name, changed in {"nan_reward": {"reward": float("nan")}, "negative_group": {"group_index": -1},
                          "huge_token": {"tokens": [5, 10**15, 7]}, "sound": {}}.items():
        dumps[name] = write_dump(tmp_path / f"{name}.rld", 1, [sample(), sample(sample_index=1, **changed)],
                                 config_facts={})
    outcomes = run_batch([
        ["dump", "convert", str(set_build), str(tmp_path / "set.rld")],
        ["dump", "convert", str(ordered_build), str(tmp_path / "ordered.rld")],
        ["dump", "verify", str(dumps["nan_reward"])],
        ["dump", "verify", str(dumps["negative_group"])],
        ["dump", "verify", str(dumps["huge_token"])],
        ["dump", "verify", str(dumps["sound"]), "--vocab-size", "8"],
        ["dump", "verify", str(dumps["sound"]), "--vocab-size", "7"],
    ])
    for source, outcome in zip((set_build, ordered_build), outcomes[:2], strict=True):
        assert outcome["status"] == 1 and "Traceback" not in outcome["stderr"]
        assert outcome["stderr"].strip().splitlines() == [
            line for line in outcome["stderr"].strip().splitlines() if line.startswith(f"error: {source}: ")]
        assert "its pickle fails to build (TypeError" in outcome["stderr"]
    assert not (tmp_path / "set.rld").exists() and not (tmp_path / "ordered.rld").exists()
    expected = {
        "nan_reward": "sample #1 (0/1): reward nan is not a finite number",
        "negative_group": "sample #1 (-1/1): group_index -1 is negative",
        "huge_token": "sample #1 (0/1): token id 1000000000000000 does not fit int32",
    }
    for (name, reason), outcome in zip(expected.items(), outcomes[2:5], strict=True):
        assert outcome["status"] == 1, outcome
        assert outcome["stdout"].splitlines()[0].startswith(f"INVALID {dumps[name]}: {reason}"), outcome["stdout"]
    assert outcomes[5]["status"] == 0 and outcomes[5]["stdout"].startswith(f"ok {dumps['sound']}")
    assert outcomes[6]["status"] == 1 and "token id 7 is outside the vocabulary of 7" in outcomes[6]["stdout"]
    for outcome in outcomes:
        assert outcome["growth_mib"] < MAX_GROWTH_MIB and outcome["children"] == 0
