"""Which of node 0's directories the other nodes see: a marker file written by node 0, looked for by node k.

Owns the markers: node 0 writes `<dir>/.rayless-shared-<nonce>` holding the nonce in each directory that must
be shared (the run directory, which holds the weight snapshots, and `--save`); node k looks for the same file
at the same path with the same content. Only a filesystem both see passes: a node-local directory of the same
name has no such file. Node 0 removes its markers when the run ends.

Invariant: a marker holds a random nonce that only node 0 and the nodes it welcomed know, so a leftover from
an earlier run never passes for this one's.
"""

from __future__ import annotations

import contextlib
import secrets
from pathlib import Path

MARKER_PREFIX = ".rayless-shared-"


def write_markers(directories: list[Path]) -> list[list[str]]:
    """Node 0: one marker per directory (created when missing); [directory, file name, content] each."""
    markers = []
    for directory in dict.fromkeys(Path(d).resolve() for d in directories):
        directory.mkdir(parents=True, exist_ok=True)
        nonce = secrets.token_hex(16)
        name = MARKER_PREFIX + nonce[:12]
        (directory / name).write_text(nonce)
        markers.append([str(directory), name, nonce])
    return markers


def remove_markers(markers: list[list[str]]) -> None:
    for directory, name, _ in markers:
        with contextlib.suppress(OSError):
            (Path(directory) / name).unlink()


def unseen(markers: list[list[str]]) -> list[str]:
    """Node k: the directories whose marker it does not find as node 0 wrote it."""
    missing = []
    for directory, name, nonce in markers:
        if not name.startswith(MARKER_PREFIX) or "/" in name or len(nonce) > 64:
            missing.append(directory)  # not a marker node 0 writes: nothing outside the directory is read
            continue
        try:
            seen = (Path(directory) / name).read_text()[:65] == nonce
        except (OSError, UnicodeDecodeError):
            seen = False
        if not seen:
            missing.append(directory)
    return missing
