"""Each node's share of a multi-node plan: which engines a node launches, and what every node runs.

Owns `engine_share`, the one rule that splits an engine group over the nodes (contiguous blocks, as even as it
goes, the first nodes taking one more; on a single node, all of them), and what follows from it for node 0:
the engines other nodes launch (`remote_engines`, named as their node's plan names them) and each node's counts
(`node_shares`, for the printout). Invariant: every node computes the same split from the same flags, so
engine `<group>-<i>` is the same engine in every node's plan.
"""

from __future__ import annotations

from coordinator.config.settings import Config
from coordinator.plan.backend import EngineChoice


def engine_share(count: int, num_nodes: int, node_rank: int) -> range:
    """The indices of a group's `count` engines that node `node_rank` launches: contiguous blocks over the
    nodes, as even as it goes, the first nodes taking one more (all of them on a single node)."""
    base, extra = divmod(count, num_nodes)
    start = node_rank * base + min(node_rank, extra)
    return range(start, start + base + (1 if node_rank < extra else 0))


def remote_engines(config: Config, node_rank: int, rollout: EngineChoice | None,
                   eval_: EngineChoice | None) -> tuple[tuple[str, str, int], ...]:
    """(name, group, node) of every launched engine that a node other than `node_rank` launches."""
    nodes = config.cluster.actor_num_nodes
    found = []
    for group, count, choice in (("rollout", config.num_launched_rollout_engines, rollout),
                                 ("eval", config.num_eval_engines, eval_)):
        if choice is None:
            continue
        for node in range(nodes):
            if node != node_rank:
                found += [(f"{group}-{index}", group, node) for index in engine_share(count, nodes, node)]
    return tuple(found)


def node_shares(config: Config, rollout: EngineChoice | None,
                eval_: EngineChoice | None) -> tuple[tuple[int, int, int, int], ...]:
    """(node, training ranks, rollout engines, eval engines) of every node."""
    nodes = config.cluster.actor_num_nodes
    ranks = config.cluster.actor_num_gpus_per_node if config.needs_train_ranks else 0
    rollout_count = config.num_launched_rollout_engines if rollout is not None else 0
    eval_count = config.num_eval_engines if eval_ is not None else 0
    return tuple((node, ranks, len(engine_share(rollout_count, nodes, node)),
                  len(engine_share(eval_count, nodes, node))) for node in range(nodes))
