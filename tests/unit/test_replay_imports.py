"""A replay run's coordinator imports no HTTP library: httpx and aiohttp (with httpx's CLI, rich and click)
cost about a third of a replay run's start-up, and a replay run talks to no engine. And the CLI with the run's
modules imports no numpy (86 modules, ~60 ms): only packing a sample's arrays for the ranks needs it.

The modules below are the ones a replay run imports, at module level and lazily, on its way to the first
train step (read from `python -X importtime` of `rayless train --load-debug-rollout-data ...`: the imports at
the top of that tree). A new module-level import of the engine client anywhere beneath them fails this test.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

REPLAY_RUN_IMPORTS = [
    "coordinator.cli",
    "coordinator.checks.preflight",
    "coordinator.checks.trainable",
    "coordinator.plan.layout",
    "coordinator.rewards.rules",
    "workers.hook_loading",
    "coordinator.observe.progress",
    "coordinator.rollout.epochs",
    "coordinator.run",
    "coordinator.hooks.args",
    "coordinator.loop",
    "coordinator.rollout.hook_services",
    "coordinator.rollout.manager",
    "replay.loader",
]
HTTP_LIBRARIES = ["httpx", "aiohttp", "httpx_aiohttp"]


def imported_after(modules: list[str], libraries: list[str] = HTTP_LIBRARIES, then: str = "") -> dict[str, bool]:
    """Which of `libraries` a fresh interpreter holds after importing `modules` (and running `then`)."""
    script = (
        "import importlib, json, sys\n"
        f"for name in {modules!r}: importlib.import_module(name)\n"
        f"{then}\n"
        f"print(json.dumps({{name: name in sys.modules for name in {libraries!r}}}))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_a_replay_runs_modules_import_no_http_library() -> None:
    assert imported_after(REPLAY_RUN_IMPORTS) == dict.fromkeys(HTTP_LIBRARIES, False)


def test_the_engine_client_does_import_them() -> None:
    # the check above can fail: the client's own module brings both libraries in
    assert imported_after(["coordinator.engines.client"]) == dict.fromkeys(HTTP_LIBRARIES, True)


def test_the_cli_and_the_runs_modules_import_no_numpy_until_an_array_is_packed() -> None:
    modules = ["coordinator.cli", "coordinator.run", "workers.protocol"]
    assert imported_after(modules, ["numpy"]) == {"numpy": False}
    packing = ("from workers.protocol.arrays import Kind, PackedArray\n"
               "assert PackedArray.of(Kind.FLOATS, [0.5, -1.25]).numpy().tolist() == [0.5, -1.25]")
    assert imported_after(modules, ["numpy"], then=packing) == {"numpy": True}
