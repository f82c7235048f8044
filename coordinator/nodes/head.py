"""Node 0's multi-node pieces of one run, and what the run's services take from them.

Owns, for a run whose plan has a `NodeLayout` (node 0 of several): the control token (created in the
`--control-token-file` when absent, masked in every log record), the `NodeRegistry` service, and the
arguments the run's services get from them: the training group's token and the address its ranks dial
(`rank_kwargs`), each engine fleet's remote engines (`fleet_kwargs`, `watch`), and the weight-update group's
store address (`weight_host`: the node where rank 0 runs now). `coordinator.run` wires them; it stays the one
place where services are started.

Invariant: the registry welcomes a node only once the control channel listens (its `before_welcome` waits for
the training group's `listening`), so a node's ranks never dial a closed port.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio.abc

from coordinator.nodes.registry import NodeRegistry

if TYPE_CHECKING:
    from coordinator.config import Config
    from coordinator.engines.fleet import EngineFleet
    from coordinator.plan import PlacementPlan
    from coordinator.plan.layout import NodeLayout
    from coordinator.train.group import TrainGroup


class Head:
    """Build with `await Head.prepare(...)` before the services, `await head.start(...)` once the training group
    and the fleets are built; `finish(ok=...)` before the run's task group is cancelled."""

    def __init__(self, *, plan: PlacementPlan, layout: NodeLayout, token: str, registry: NodeRegistry) -> None:
        self.plan = plan
        self.layout = layout
        self.token = token
        self.registry = registry
        self.train_group: TrainGroup | None = None

    @classmethod
    async def prepare(cls, config: Config, plan: PlacementPlan, run_dir: Path) -> Head:
        from coordinator.config.secrets import mask_in_logs

        layout = plan.layout
        assert layout is not None and layout.is_coordinator
        token = await layout.token.obtain(create=True)
        mask_in_logs(token)
        save = Path(config.checkpoint.save) if config.checkpoint.save else None
        disk_sync = config.needs_engines and config.needs_train_ranks \
            and config.sglang.update_weight_transfer_mode == "disk"
        registry = NodeRegistry(
            layout=layout, token=token, engine_nodes={name: node for name, _, node in plan.remote_engines},
            shared_dirs=[run_dir, *([save] if save is not None else [])],
            disk_sync_dir=run_dir if disk_sync else None, save_dir=save)
        return cls(plan=plan, layout=layout, token=token, registry=registry)

    async def start(self, task_group: anyio.abc.TaskGroup, train_group: TrainGroup | None) -> None:
        """Start the registry; `train_group` is the run's training group (None when the run trains nothing)."""
        self.train_group = train_group

        async def control_channel_listening() -> None:
            if train_group is not None:
                await train_group.listening.wait()

        async def drop_its_ranks(node: int, reason: str) -> None:
            if train_group is not None:  # a node that lost power sends no FIN: its ranks' connections would linger
                await train_group.server.drop_node(node, reason)

        self.registry.before_welcome = control_channel_listening
        self.registry.on_node_lost = drop_its_ranks
        await task_group.start(self.registry.run)

    def rank_kwargs(self) -> dict[str, Any]:
        """TrainGroup arguments: the run's token, and the address every node's ranks dial."""
        return {"token": self.token, "advertise_host": self.layout.control_host}

    def fleet_kwargs(self, group: str) -> dict[str, Any]:
        """EngineFleet arguments: the engines of `group` that other nodes launch, and where their URLs come from."""
        remote = self.plan.remote_engine_nodes(group)
        return {"remote": self.registry, "remote_engines": remote} if remote else {}

    def watch(self, fleet: EngineFleet) -> None:
        self.registry.watch(fleet)

    def weight_host(self) -> str:
        """The weight-update group's store address: the node where rank 0 runs now, as node 0 reaches it."""
        group = self.train_group
        rank0 = group.ranks.get(0) if group is not None else None
        node = rank0.node_rank if rank0 is not None else 0
        return self.registry.node_host(node) or self.layout.control_host

    def finish(self, *, ok: bool, reason: str = "") -> None:
        self.registry.finish(ok=ok, reason=reason)

    def summary(self) -> dict[str, Any]:
        """What the nodes did, for the run's summary: joined / lost / back events and refused connections."""
        return {"num_nodes": self.layout.num_nodes,
                "events": [{"node": node, "event": what, "detail": detail}
                           for node, what, detail in self.registry.events],
                "refusals": list(self.registry.refusals)}


@contextmanager
def reporting_outcome(head: Head | None) -> Iterator[None]:
    """Around the training loop: the other nodes are told the run succeeded when the block returns, and the
    failure when it raises (no-op on a single node)."""
    if head is None:
        yield
        return
    try:
        yield
    except Exception as error:
        from coordinator.lifecycle.failures import failure_line

        head.finish(ok=False, reason=failure_line(error))
        raise
    head.finish(ok=True)
