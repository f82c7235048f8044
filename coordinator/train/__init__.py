"""The coordinator's side of training: the torchrun ranks behind one `TrainGroup`.

Modules, one concern each (import them by their own path; this package re-exports nothing):
  * `group`: `TrainGroup`, the ranks' lifetime the run starts — its start protocol and teardown; it is given
    its `TorchrunSpec` whole and holds the command API (`group.commands`).
  * `commands`: `TrainCommands`, the command API (init, train, save, load, weights, offload / onload) the
    loop, the weight sync and the colocation are handed.
  * `settings`: `train_settings(config)`, the ranks' settings built once from the config's slices.
  * `channel`: the control-channel server — handshake, membership, the call lock.
  * `connection`: one rank's connection and the replies pending on it.
  * `calls`: one call — every rank's frame encoded before any is sent, the replies gathered.
  * `torchrun`: the torchrun child process — command line, environment, launch, exit, log tail.
  * `recovery`: train FT — bringing restarted ranks back to the last checkpoint before a step is resent.
  * `planning`: pure batch planning and metric reduction (no anyio, no I/O).
  * `errors`: `RankFailure` and `RankCommandError`, what callers catch.

Invariant of the package: it imports only `workers.protocol` from `workers`, and never torch.
"""
