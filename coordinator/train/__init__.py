"""The coordinator's side of training: the torchrun ranks behind one `TrainGroup`.

Modules, one concern each (import them by their own path; this package re-exports nothing):
  * `group`: `TrainGroup`, the facade the run uses — its start protocol, teardown and command API.
  * `channel`: the control-channel server — listener, handshake, one connection per rank, pending calls.
  * `torchrun`: the torchrun child process — command line, environment, launch, exit, log tail.
  * `recovery`: train FT — bringing restarted ranks back to the last checkpoint before a step is resent.
  * `planning`: pure batch planning and metric reduction (no anyio, no I/O).
  * `errors`: `RankFailure` and `RankCommandError`, what callers catch.

Invariant of the package: it imports only `workers.protocol` from `workers`, and never torch.
"""
