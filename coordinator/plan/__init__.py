"""The placement plan: which process runs where, computed once at start-up, the one source of every launch.

Modules: `gpus` (the GPUs the node shows, found without torch; `RAYLESS_PLAN_GPU_COUNT` injects a count for
planning tests and `--dry-run`), `backend` (`--engine-backend` resolved per engine group: SGLang or our
engine, on CUDA or the CPU), `demands` (GPU demands and the placement policies), `records` (the frozen plan:
the slots every launcher takes its command line, port and environment from), `placement` (building the plan;
`plan_for_launch` / `plan_for_dry_run`), `nodes` (each node's share of a multi-node plan), `render` (the plan
as text, secrets masked), `snapshots` (where weight snapshots go: tmpfs in colocation).

Extending it: colocation is a placement policy (`demands.POLICIES["colocate"]`: engines placed on the ranks'
GPUs instead of after them) plus the plan's `SwapPlan` (who releases memory each step). On several nodes each
node plans its own share from the same flags (`nodes`: every node runs its ranks and a block of each engine
group; node 0 learns the others' engines by name, and the plan carries the `coordinator.plan.layout.NodeLayout`).
Importing this package imports no torch.
"""

from coordinator.plan.backend import EngineChoice, choose_engines, sglang_installed
from coordinator.plan.demands import POLICIES, GpuDemand
from coordinator.plan.gpus import PLAN_GPU_COUNT_ENV, GpuInventory, detect_gpus
from coordinator.plan.placement import build_plan, plan_for_dry_run, plan_for_launch, plan_node
from coordinator.plan.records import (
    EngineSlot,
    NodePlan,
    PlacementPlan,
    RanksSlot,
    RouterSlot,
    SwapPlan,
    WeightSyncPlan,
)
from coordinator.plan.render import describe_plan, where_text
from coordinator.plan.snapshots import SnapshotPlace, remove_tmpfs_snapshots, snapshot_place

__all__ = [
    "PLAN_GPU_COUNT_ENV",
    "POLICIES",
    "EngineChoice",
    "EngineSlot",
    "GpuDemand",
    "GpuInventory",
    "NodePlan",
    "PlacementPlan",
    "RanksSlot",
    "RouterSlot",
    "SnapshotPlace",
    "SwapPlan",
    "WeightSyncPlan",
    "build_plan",
    "choose_engines",
    "describe_plan",
    "detect_gpus",
    "plan_for_dry_run",
    "plan_for_launch",
    "plan_node",
    "remove_tmpfs_snapshots",
    "sglang_installed",
    "snapshot_place",
    "where_text",
]
