"""miles' agent abort hook: when the rollout aborts its stragglers, the `abort(args)` defined beside the
`--custom-agent-function-path` agent (same module), if there is one, is awaited. Invariant: a missing hook is
no error and a failing one is logged, never raised: the rollout's abort goes on."""

from __future__ import annotations

import argparse
import inspect
import logging

from workers.hook_loading import HookLoadError, load_object

log = logging.getLogger(__name__)

FLAG = "--custom-agent-function-path"


async def call_agent_abort_hook(args: argparse.Namespace) -> None:
    """miles' `call_agent_abort_hook`: when the rollout aborts its stragglers, the `abort(args)` beside the
    agent (same module), if there is one, tells the agent's backend to stop; its failure is logged."""
    path = getattr(args, "custom_agent_function_path", None)
    if not path:
        return
    module = path.rpartition(":")[0] if ":" in path else path.rpartition(".")[0]
    try:
        hook = load_object(f"{module}:abort", what=f"{FLAG} (its abort hook)")
    except HookLoadError:  # no abort beside the agent: nothing to tear down
        return
    try:
        result = hook(args)
        if inspect.isawaitable(result):
            await result
    except Exception as error:
        log.warning("the agent's abort hook %s.abort failed: %r", module, error)
