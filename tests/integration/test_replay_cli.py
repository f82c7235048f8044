"""The replay tools and the pickle payload as real subprocesses: `python -m replay.tools verify`'s output and
exit codes, and the proof that the payload refused in test_replay_import.py runs when unpickled naively."""

from __future__ import annotations

import pickle  # noqa: TID251 - builds a malicious test input; never used to read anything in rayless
import subprocess
import sys
from pathlib import Path

from replay import format as fmt
from tests.support import hostile_dumps
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


def test_verify_reports_every_hostile_file_and_goes_on(tmp_path: Path) -> None:
    """An extension nested 200 deep (was: SIGSEGV, exit 139) and a map keyed by a list (was: TypeError,
    which stopped verify) are each reported, and the files after them are still checked."""
    nested = hostile_dumps.nested_tuple_dump(tmp_path / "1.rld", 200)
    good = write_sample_dump(tmp_path / "2.rld")
    unhashable = hostile_dumps.framed_dump(tmp_path / "3.rld", fmt.packb(hostile_dumps.good_header()),
                                           [hostile_dumps.sample_payload(b"\x81\x91\x00\x00")])
    done = subprocess.run([sys.executable, "-m", "replay.tools", "verify", str(nested), str(good), str(unhashable)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done
    lines = done.stdout.splitlines()
    assert lines[0].startswith(f"CORRUPT {nested}: sample #0 of 1: containers nest deeper than 32 levels")
    assert lines[1].startswith(f"ok {good}")
    assert lines[2].startswith(f"CORRUPT {unhashable}: sample #0 of 1: not valid msgpack: unhashable")
    assert lines[3] == "2 of 3 file(s) corrupt"
    assert "Traceback" not in done.stderr


def test_show_prints_header_strings_as_text(tmp_path: Path) -> None:
    strings = ["[/]", "[bold red]x[/bold red]", "[link=file:///etc]y[/link]", ":smile:", "[/oops"]
    path = fmt.write_dump(tmp_path / "1.rld", 1, [hostile_dumps.good_sample()],
                          config_facts={f"k{i}{s}": s for i, s in enumerate(strings)})
    done = subprocess.run([sys.executable, "-m", "replay.tools", "show", str(path)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    for i, text in enumerate(strings):
        assert f"config.k{i}{text}" in done.stdout and f"│ {text}" in done.stdout, text
