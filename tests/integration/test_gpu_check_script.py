"""`bench/gpu_check.sh --cpu`: the prepared GPU check runs its steps at tiny sizes on the CPU, so the script the
lead runs on a lent GPU cannot rot (issue 11 item 10, issue 12)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# Six steps, each a few processes importing torch: minutes on a loaded 2-core machine.
pytestmark = pytest.mark.timeout(900)


def test_the_gpu_check_passes_in_its_cpu_mode(tmp_path: Path) -> None:
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable}
    done = subprocess.run(["bash", str(ROOT / "bench" / "gpu_check.sh"), "--cpu"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=840, check=False)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    summary = (tmp_path / "summary.txt").read_text().splitlines()
    steps = ["env", "gpu-tests", "colocate", "weight-sync", "train-shapes", "offload"]
    assert [line.split()[0] for line in summary] == [f"[{step}]" for step in steps]
    assert all(" PASS " in line for line in summary), summary
    for step in steps:
        assert f"================ [{step}] PASS" in done.stdout
        assert (tmp_path / f"{step}.log").stat().st_size > 0
    colocate = (tmp_path / "colocate.log").read_text()
    assert "colocated phases, median seconds per step" in colocate and "resume_kv" in colocate
    assert (tmp_path / "colocate-runs" / "colocated" / "metrics.jsonl").is_file()
    assert "colocated sync: export + engine load" in (tmp_path / "weight-sync.log").read_text()
    shapes = (tmp_path / "train-shapes.log").read_text()
    assert "response lengths:" in shapes and "control channel:" in shapes and "tokens/s for the train" in shapes
    # packed attention's paths side by side: both sdpa paths run, varlen (CUDA-only) says why it did not
    assert "packed attention paths:" in shapes and "varlen: not run here (" in shapes
    assert all(f"  {path}: " in shapes and "kernel calls per micro-batch" in shapes for path in ("per_sample", "grouped"))
    assert "bit-identical after every onload: True" in (tmp_path / "offload.log").read_text()
