"""Starting what hooks use in a run: their HTTP client and the address they post to.

Owns `start_hook_services`, called by the run once the rollout manager is built: it opens the hooks' client
for the rest of the run (a task of the run's task group holds it) and binds `args.sglang_router_ip/port` —
the router the run routes through when there is one, else the coordinator's own endpoint
(`coordinator.hooks.endpoint`), started only when a hook will post (a custom generate function or a slime-style
rollout function); with `--use-session-server`, miles' session server too (`coordinator.sessions`). Invariant: both end with the run's task group; nothing here outlives it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import anyio
import anyio.abc

if TYPE_CHECKING:
    from coordinator.hooks.endpoint import HookEndpoint
    from coordinator.hooks.runtime import HookRuntime
    from coordinator.rollout.manager import RolloutManager


async def _hold_open(runtime: HookRuntime, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
                     ) -> None:
    async with runtime:
        task_status.started()
        await anyio.sleep_forever()


async def start_hook_services(manager: RolloutManager, *, task_group: anyio.abc.TaskGroup, router_url: str | None,
                              seed: int, api_key: str | None) -> HookEndpoint | None:
    """Open the hooks' client and bind their address; returns the endpoint when one was started."""
    runtime = manager.hook_runtime
    if runtime is None or manager.context is None or manager.context._dispatcher is None:
        return None  # no engines in this mode: nothing for a hook to post to
    await task_group.start(_hold_open, runtime)
    if manager.config.hooks.use_session_server is not None:
        from coordinator.sessions.service import start_session_server

        await start_session_server(manager, task_group=task_group, api_key=api_key)
    if router_url is not None:
        parts = urlsplit(router_url)
        assert parts.hostname is not None and parts.port is not None
        runtime.bind_address(parts.hostname, parts.port)
        return None
    if not manager.needs_hook_endpoint:
        return None
    from coordinator.hooks.endpoint import HookEndpoint

    endpoint: Any = HookEndpoint(dispatcher=manager.context.dispatcher, routes=runtime.routes, seed=seed,
                                 api_key=api_key)
    await task_group.start(endpoint.run)
    runtime.bind_address(endpoint.host, endpoint.port)
    return endpoint
