"""More than one node: the same `rayless train` command on every node, node 0 the coordinator.

No cluster manager of our own: SLURM (srun, one task per node) or the user's launcher places the processes,
torchrun does the rendezvous and restarts the ranks. This package adds only what torchrun does not know: which
node this process is and how it finds node 0, the control token every node holds, and node 0's view of the
engines the other nodes launch.

Modules: `layout` (the node rank, node 0's address and ports, from flags, SLURM's or torchrun-style variables),
`token` (the control token from a 0600 file on a shared filesystem or the launcher's environment), `wire` (what
node k and node 0 say to each other), `registry` (node 0's end: authenticated node connections, remote engines,
lost and returning nodes), `agent` (node k's process: its torchrun agent and engines, reported to node 0),
`head` (node 0's pieces wired into a run), `shared` (which of node 0's directories node k sees).

The protocol, end to end:
1. Every node resolves the same layout from the same flags and its own environment (`resolve_layout`):
   node 0's host, the rendezvous port P (MASTER_PORT, default 29500), the control channel on P+1 and the node
   registry on P+2 (or `--control-port` C and C+1).
2. Node 0 obtains the token (creating `--control-token-file` when absent), opens the control channel and the
   registry, launches its torchrun (hosting the c10d rendezvous store) and engines.
3. Node k obtains the token (waiting for the file, or from `RAYLESS_CONTROL_TOKEN`), connects to the registry
   and proves the token; once welcomed it launches its torchrun (its ranks dial the control channel with the
   token in their environment) and its engines, and reports each engine's URL. Node 0's fleets probe, update
   and recover those engines like their own.
4. A node whose connection closes or falls silent is lost: its engines are marked dead; its ranks fail on the
   control channel. With train FT torchrun re-forms the world once the same command runs on that node again;
   without it the run ends naming the node. At the end node 0 tells every node whether the run succeeded.
"""
