"""Hooks that misbehave as a user's can (tests/integration/test_hook_escapes.py): a generate function that
raises its own CancelledError, then KeyboardInterrupt, before it generates; a sync reward function that exits on
its first sample and, once the first step is trained, blocks in time.sleep(600) (writing `HOOK_BLOCKED` first)."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any

from coordinator.hooks import generate as slime_generate

CALLS = {"generate": 0, "reward": 0}


async def generate(args: Any, sample: Any, sampling_params: dict[str, Any]) -> Any:
    CALLS["generate"] += 1
    if CALLS["generate"] == 1:
        raise asyncio.CancelledError  # nothing of the run's was cancelled: the agent's own
    if CALLS["generate"] == 2:
        raise KeyboardInterrupt
    return await slime_generate(args, sample, sampling_params)


def reward(sample: Any) -> float:
    CALLS["reward"] += 1
    if CALLS["reward"] == 1:
        raise SystemExit(4)
    metrics = Path(os.environ["HOOK_RUN_DIR"]) / "metrics.jsonl"
    if metrics.exists() and metrics.stat().st_size:
        Path(os.environ["HOOK_BLOCKED"]).write_text("blocked")
        time.sleep(600)
    return 1.0
