"""Shared fixtures: the tiny model (built once per session), the anyio backend, and the orphan check.

Tests live in `unit/` (no process started) and `integration/` (real engines, torchrun, routers, CLIs as
subprocesses); what they share lives in the `tests.support` package, imported as `tests.support.<module>`
here, in child processes and in `bench/`. Every test that starts a process must end it: the plugin
`tests.support.orphans` asserts at the end of the session that the pytest process has no child left.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

# Before anything imports them: shared checks in tests.support report their asserts like test modules do.
pytest.register_assert_rewrite("tests.support")

# pytester: the orphan check is itself tested in a pytest session of its own.
pytest_plugins = ["tests.support.orphans", "tests.support.schedule", "pytester"]

REPO_ROOT = Path(__file__).resolve().parent.parent
PYTHON = sys.executable

# Child processes (engines, torchrun, ranks) must find the project's packages, and `tests.support` (e.g. a
# `--custom-rm-path tests.support.rollout_fns:...`), from any working directory.
os.environ["PYTHONPATH"] = os.pathsep.join(
    [str(REPO_ROOT), *([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])]
)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from workers.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-model"))
