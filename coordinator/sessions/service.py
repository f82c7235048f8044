"""Starting the session server in a run: one more service in the run's task group, over its dispatcher.

Owns `start_session_server`: builds the TITO tokenizer and message matcher from the hooks slice, starts the
server on `--session-server-ip/-port`, and binds what hooks read — `args.session_server_ip`,
`args.session_server_port` and miles' `args.session_server_ports` — and `HookRuntime.sessions` (how the
agentic generate finds it in-process). Invariant: it ends with the run's task group.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import anyio.abc

from coordinator.sessions.server import SessionServer
from coordinator.sessions.tito import resolve_matcher, tito_tokenizer
from workers.vlm_processor import VlmProcessor, vlm_model_type

if TYPE_CHECKING:
    from coordinator.rollout.manager import RolloutManager


async def start_session_server(manager: RolloutManager, *, task_group: anyio.abc.TaskGroup,
                               api_key: str | None) -> SessionServer:
    context, runtime, hooks = manager.context, manager.hook_runtime, manager.config.hooks
    assert context is not None and runtime is not None
    args: Any = runtime.args
    tito = tito_tokenizer(hooks.tito_model, context.tokenizer, getattr(args, "apply_chat_template_kwargs", None))
    matcher = resolve_matcher(hooks.session_message_matcher)
    checkpoint = manager.config.rollout.hf_checkpoint
    vision = VlmProcessor(checkpoint) if checkpoint and vlm_model_type(checkpoint) else None
    server = SessionServer(dispatcher=context.dispatcher, tito=tito, matcher=matcher, vision=vision,
                           api_key=api_key, host=hooks.session_server_ip,
                           port=hooks.session_server_port[0] if hooks.session_server_port else 0)
    await task_group.start(server.run)
    args.session_server_ip, args.session_server_port = server.host, server.port
    args.session_server_ports = [server.port]
    runtime.sessions = server
    return server
