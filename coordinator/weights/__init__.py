"""Training weights reaching the engines: the per-step sync (disk snapshots or a distributed broadcast) and
the colocated memory hand-over around it. Imports engines and the train group's interface; only the wiring
imports it."""
