"""Engines as the coordinator sees them: the HTTP client, local launching, the fleet, sglang-router, health.

Re-exports nothing (importers name the module, so importing one part never imports the HTTP client):
  client.py  EngineClient: one pool for all engines, the request loop with its retries
  api.py     EngineAPI: one engine's endpoints; stream.py the streaming /generate reader
  errors.py  the typed EngineError family; policy.py RetryPolicy / NO_RETRY
  transport.py  each attempt's deadlines; httpx/aiohttp failures and error answers mapped to EngineErrors
  stall.py   a reply that stops moving: the body rule (ReplyClock), the head rule and a generate's bound (HeadWatch)
  deadline.py  a control call (a weight load, a pin) acknowledged within its bound, or EngineOverdue naming it
  bounded.py replies read under a byte cap and decoded bounded; replies.py the check of every /generate reply
  reply_decode.py  a /generate answer read from its bytes: typed decode, the same verdict as replies.py
  spec.py    EngineLaunchSpec, ports and log paths: what a launch needs, importable without the HTTP client
  launch.py  EngineProcess: starting engines (on their planned port, or another with a warning; reporting
             start-up phases) and ending their process groups
  fleet.py   EngineFleet / EngineHandle / EngineState: the only owner of engine states
  router.py  RouterHandle: sglang-router as a child process and its worker registration
  health.py  the health monitor and fault injector; recovery.py a dead engine's way back into dispatch
"""
