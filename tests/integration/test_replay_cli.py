"""The replay tools and the pickle payload as real subprocesses: `python -m replay.tools verify`'s output and
exit codes, and the proof that the payload refused in test_replay_import.py runs when unpickled naively."""

from __future__ import annotations

import pickle  # noqa: TID251 - builds a malicious test input; never used to read anything in rayless
import subprocess
import sys
from pathlib import Path

from tests.support.replay_inputs import MarkerPayload, write_sample_dump


def test_payload_is_live_when_unpickled_naively(tmp_path: Path) -> None:
    # Proves the payload refused in test_replay_import.py really has a side effect, so its absence there means
    # something.
    marker = tmp_path / "pwned"
    src = tmp_path / "evil.pkl"
    src.write_bytes(pickle.dumps({"rollout_id": 0, "samples": [MarkerPayload(marker)]}))
    subprocess.run(
        [sys.executable, "-c", f"import pickle; pickle.loads(open({str(src)!r}, 'rb').read())"], check=True
    )
    assert marker.exists()


def test_cli_as_a_process(tmp_path: Path) -> None:
    good = write_sample_dump(tmp_path / "1.rld")
    bad = tmp_path / "2.rld"
    bad.write_bytes(good.read_bytes()[:40])
    ok = subprocess.run(
        [sys.executable, "-m", "replay.tools", "verify", str(good)], capture_output=True, text=True
    )
    assert ok.returncode == 0 and ok.stdout.startswith(f"ok {good}")
    fail = subprocess.run(
        [sys.executable, "-m", "replay.tools", "verify", str(good), str(bad)], capture_output=True, text=True
    )
    assert fail.returncode == 1 and f"CORRUPT {bad}: truncated" in fail.stdout
