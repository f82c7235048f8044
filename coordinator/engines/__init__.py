"""Engines as the coordinator sees them: the HTTP client, local launching, the fleet, and sglang-router.

Owns nothing itself; re-exports the public API of its modules:
  client.py  EngineClient: one pool for all engines, the request loop with its retries
  api.py     EngineAPI: one engine's endpoints; stream.py the streaming /generate reader
  errors.py  the typed EngineError family; policy.py RetryPolicy / NO_RETRY and each request's deadline
  bounded.py replies read under a byte cap and decoded bounded; replies.py the check of every /generate reply
  reply_decode.py  a /generate answer read from its bytes: typed decode, the same verdict as replies.py
  launch.py  EngineLaunchSpec / EngineProcess: starting engines (on their planned port, or another with a
             warning; reporting start-up phases) and ending their process groups
  fleet.py   EngineFleet / EngineHandle / EngineState: the only owner of engine states
  router.py  RouterHandle: sglang-router as a child process and its worker registration
"""

from coordinator.engines.api import EngineAPI
from coordinator.engines.client import EngineClient
from coordinator.engines.errors import (
    EngineError,
    EngineHTTPError,
    EngineReplyError,
    EngineStreamError,
    EngineTimeout,
    EngineUnreachable,
)
from coordinator.engines.fleet import EngineFleet, EngineHandle, EngineState
from coordinator.engines.launch import (
    EngineLaunchError,
    EngineLaunchSpec,
    EngineProcess,
    claim_port,
    free_port,
    launch_engine,
)
from coordinator.engines.policy import NO_RETRY, RetryPolicy
from coordinator.engines.router import RouterError, RouterHandle

__all__ = [
    "NO_RETRY",
    "EngineAPI",
    "EngineClient",
    "EngineError",
    "EngineFleet",
    "EngineHTTPError",
    "EngineHandle",
    "EngineLaunchError",
    "EngineLaunchSpec",
    "EngineProcess",
    "EngineReplyError",
    "EngineState",
    "EngineStreamError",
    "EngineTimeout",
    "EngineUnreachable",
    "RetryPolicy",
    "RouterError",
    "RouterHandle",
    "claim_port",
    "free_port",
    "launch_engine",
]
