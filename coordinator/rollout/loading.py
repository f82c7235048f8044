"""Hook paths to Python objects: the one rule lives in `workers.hook_loading` (the training ranks load hooks
too, and `workers` never imports `coordinator`); re-exported here for the coordinator's code."""

from __future__ import annotations

from workers.hook_loading import HookLoadError, load_object

__all__ = ["HookLoadError", "load_object"]
