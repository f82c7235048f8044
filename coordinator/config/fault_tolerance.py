"""The fault-tolerance slice: which components are protected, how engines are probed, how often ranks restart,
and the fault injection that exercises it.

Owns these flags. Whether a component's FT is *on* is a cross-slice fact (it also needs engines or ranks to
exist): `Config.rollout_ft_enabled`, `Config.train_ft_enabled`, `Config.health_monitor_enabled`.
"""

from __future__ import annotations

from dataclasses import dataclass

from coordinator.config.fields import Slice, flag

FT_COMPONENTS = ("rollout", "train")


@dataclass(frozen=True)
class FaultToleranceConfig(Slice):
    TITLE = "fault-tolerance"
    DESCRIPTION = "per-component fault tolerance and its health checks"

    use_fault_tolerance: bool = flag(False, help="enable fault tolerance for --ft-components")
    ft_components: frozenset[str] = flag(
        frozenset({"rollout"}), help="components to protect: rollout, train ('rollout,train' or 'rollout train')",
        choices=FT_COMPONENTS, split_commas=True, metavar="COMPONENT")
    rollout_health_check_interval: float = flag(30.0, help="seconds between engine probes", above=0)
    rollout_health_check_timeout: float = flag(30.0, help="seconds a probe may take", above=0)
    rollout_health_check_first_wait: float = flag(0.0, help="grace seconds after an engine (re)starts", minimum=0)
    rollout_health_check_failure_threshold: int = flag(2, help="failed probes before an engine is dead", minimum=1)
    engine_stall_timeout_s: float = flag(120.0, help="seconds an engine's reply may go without progress (a body "
                                         "or stream event dripping; no answer from an engine that answers /health "
                                         "neither) before the request fails as stalled and goes to another engine",
                                         above=0, metavar="SECONDS")
    engine_token_timeout_s: float = flag(1.0, help="seconds per requested new token a non-streamed /generate may "
                                         "take beyond --engine-stall-timeout-s (time paused for a weight update "
                                         "not counted) before it fails as stalled and goes to another engine, even "
                                         "from an engine that answers /health", above=0, metavar="SECONDS")
    max_restarts: int = flag(3, help="torchrun restarts of dead ranks (train FT)", minimum=0)
    inject_engine_fault_at_rollout: int | None = flag(
        None, help="kill one rollout engine once at this rollout (FT tests)", minimum=0)
