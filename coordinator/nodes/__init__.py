"""More than one node: the same `rayless train` command on every node, node 0 the coordinator.

Owns only what torchrun does not know: which node this process is and how it finds node 0 (`layout`), the
control token every node holds (`token`), what node k and node 0 say to each other (`wire`), node 0's end
(`registry`, wired into a run by `head`), node k's process (`agent`), and which of node 0's directories node k
sees (`shared`). No cluster manager: SLURM or the user's launcher places processes, torchrun does rendezvous
and restarts. The protocol end to end: docs/multi-node.md.
"""
