"""Where the real `sglang` wheel (SGLang's own frontend) is installed for tests, and how a child process gets it.

Owns the lookup. `./run.sh test` installs the wheel and the few packages `import sglang` needs beyond ours into a
`--target` directory, `.venv/sglang-site` (never into the venv's site-packages: SGLang pins versions of
packages we also use), and exports its path as RAYLESS_SGLANG_FRONTEND_SITE. Tests that use it run it in a
child process with that directory on PYTHONPATH, so the test process never imports sglang.

A test that needs it fails (never skips) when it is missing, saying how to install it.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
ENV_VAR = "RAYLESS_SGLANG_FRONTEND_SITE"


def frontend_site() -> Path:
    candidates = [Path(os.environ[ENV_VAR])] if os.environ.get(ENV_VAR) else []
    candidates += [REPO_ROOT / ".venv" / "sglang-site", Path(sys.prefix) / "sglang-site"]
    for candidate in candidates:
        if (candidate / "sglang" / "__init__.py").is_file():
            return candidate
    pytest.fail(
        "SGLang's frontend (the real sglang wheel) is not installed; `./run.sh test` installs it into "
        f".venv/sglang-site, or set {ENV_VAR} to a directory made with `pip install --no-deps --target DIR "
        "sglang==0.5.23 triton==3.9.0 ...` (see run.sh). Looked in: " + ", ".join(map(str, candidates)),
        pytrace=False,
    )


def child_env(site: Path) -> dict[str, str]:
    """The environment of a child process that imports sglang: the site first, then this repository."""
    path = [str(site), str(REPO_ROOT)]
    if os.environ.get("PYTHONPATH"):
        path.append(os.environ["PYTHONPATH"])
    return {**os.environ, "PYTHONPATH": os.pathsep.join(path), "PYTHONWARNINGS": "ignore"}
