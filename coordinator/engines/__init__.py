"""Engines as the coordinator sees them: the HTTP client, local launching, the fleet, and sglang-router.

Owns nothing itself; re-exports the public API of its modules:
  client.py  EngineClient / EngineAPI and the typed EngineError family (one pool for all engines)
  launch.py  EngineLaunchSpec / EngineProcess: starting engines (on their planned port, or another with a
             warning; reporting start-up phases) and ending their process groups
  fleet.py   EngineFleet / EngineHandle / EngineState: the only owner of engine states
  router.py  RouterHandle: sglang-router as a child process and its worker registration
"""

from coordinator.engines.client import (
    NO_RETRY,
    EngineAPI,
    EngineClient,
    EngineError,
    EngineHTTPError,
    EngineStreamError,
    EngineTimeout,
    EngineUnreachable,
    RetryPolicy,
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
