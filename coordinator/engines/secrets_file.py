"""The file a launched engine reads its secrets from, so that none is on its command line.

Owns `secrets_file`: a YAML file (`api-key: "KEY"`, one flag a line, SGLang's `--config` format, which our
engine reads as well) in a fresh 0700 directory, the file itself created 0600 before anything is written to it.
Why a file: a command line is world-readable (`ps`, `/proc/PID/cmdline`), and SGLang reads its key from no
environment variable, only from `--api-key` or a `--config` file.

Invariants: only this user can read the file, at every moment of its life; it exists only while the launch
that made it waits for the engine to start (each engine reads it before it serves), and is removed on every
exit path, so no secret is left in the temp directory.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager


@contextmanager
def secrets_file(values: Mapping[str, str]) -> Iterator[str | None]:
    """The path of a 0600 YAML file holding `values` (flag name → value), or None when there are none."""
    if not values:
        yield None
        return
    directory = tempfile.mkdtemp(prefix="rayless-secrets-")  # 0700: only this user can list or open it
    try:
        path = os.path.join(directory, "engine.yaml")
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(descriptor, "w", encoding="utf-8") as file:
            for name, value in values.items():
                # a JSON string is a YAML double-quoted scalar: the value stays a string, whatever it looks like
                file.write(f"{name}: {json.dumps(str(value))}\n")
        yield path
    finally:
        shutil.rmtree(directory, ignore_errors=True)
