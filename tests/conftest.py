"""Shared fixtures: the tiny model (built once per session), the anyio backend, and the orphan check.

Every test that starts a process must end it; `test_zz_no_orphans.py` (run last by name) and the session
finaliser below assert that the pytest process has no child processes left.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
PYTHON = sys.executable

# Child processes (engines, torchrun, ranks) must find the project's packages from any working directory.
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
