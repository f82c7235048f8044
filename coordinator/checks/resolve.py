"""The run as it will launch, resolved once before anything starts: `resolve(config) -> Resolved`.

Owns the order in which a parsed config is finished: this node's layout (`coordinator.plan.layout.
resolve_layout`: which node this is, node 0's address), the start-up checks (`preflight`, when asked), the
rollout count (`coordinator.rollout.epochs.with_rollout_count`, the one place `num_rollout` is decided), then
the placement plan of that finished config. `rayless train` and `coordinator.run` both take the run from here,
so the loop, the ranks' schedule, the plan and `config.json` see one config. Invariant: nothing is launched;
bad input raises ConfigError (exit 2). A `--dry-run` config is resolved up to its layout only: the dry run
reports every check and plans leniently itself (`coordinator.checks.dry_run`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from coordinator.config import Config
from coordinator.plan.layout import NodeLayout, resolve_layout

if TYPE_CHECKING:
    from coordinator.plan import PlacementPlan


@dataclass(frozen=True)
class Resolved:
    #: the finished config: this node's layout applied, the rollout count set (not for a dry run)
    config: Config
    #: a multi-node run's layout (None on a single node)
    layout: NodeLayout | None
    #: what this node launches (None for a dry run)
    plan: PlacementPlan | None
    #: what resolving the layout found worth saying
    warnings: tuple[str, ...] = ()


def resolve(config: Config, *, checks: bool = True) -> Resolved:
    """`config` finished and planned; with `checks`, every start-up check runs between the layout and the count
    (the count reads the prompt data the checks verify first)."""
    config, layout, warnings = resolve_layout(config, lenient=config.debug.dry_run)
    if config.debug.dry_run:
        return Resolved(config, layout, None, tuple(warnings))
    if checks:
        from coordinator.checks.preflight import preflight

        preflight(config)
    from coordinator.plan import plan_for_launch
    from coordinator.rollout.epochs import with_rollout_count

    config = with_rollout_count(config)
    return Resolved(config, layout, plan_for_launch(config, layout), tuple(warnings))
