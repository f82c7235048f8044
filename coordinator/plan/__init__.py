"""The placement plan: which process runs where, computed once at start-up, the one source of every launch.

Modules: `gpus` (the GPUs the node shows, found without torch; `RAYLESS_PLAN_GPU_COUNT` injects a count for
planning tests and `--dry-run`), `backend` (`--engine-backend` resolved per engine group: SGLang or our
engine, on CUDA or the CPU), `placement` (the plan: GPU demands, placement policies, the slots every launcher
takes its command line, port and environment from; `plan_for_launch` / `plan_for_dry_run`), `render` (the
plan as text, secrets masked), `snapshots` (where weight snapshots go: tmpfs in colocation).

Colocation is a placement policy (`placement.POLICIES["colocate"]`: engines placed on the ranks' GPUs instead
of after them) plus the plan's `SwapPlan` (who releases memory each step). Extending it: more nodes are more `NodePlan`s in `PlacementPlan.nodes`, each from `plan_node`
with that node's share of the engines. Importing this package imports no torch.
"""

from coordinator.plan.backend import EngineChoice, choose_engines, sglang_installed
from coordinator.plan.gpus import PLAN_GPU_COUNT_ENV, GpuInventory, detect_gpus
from coordinator.plan.placement import (
    POLICIES,
    EngineSlot,
    GpuDemand,
    NodePlan,
    PlacementPlan,
    RanksSlot,
    RouterSlot,
    SwapPlan,
    WeightSyncPlan,
    build_plan,
    plan_for_dry_run,
    plan_for_launch,
    plan_node,
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
