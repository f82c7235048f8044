"""The run's status, wired: what `coordinator.run` makes once and calls at three moments.

Owns `RunStatus`: built at the start of the run (the timeline, the progress, the metrics log), `start`ed once
the services are (it takes them through `RunParts`, the shape of `coordinator.services.Services`, and starts
the status server when `--status-port` is set), and `finish`ed however the run ends, which writes
`<run_dir>/timeline.json` and `<run_dir>/status.json` (the last document, read by `rayless status` once the
run is over, saying how it ended: finished, interrupted or failed). Invariant: with `--status-port 0` (the default) no socket is opened and no task started; the
timeline and the final document are written either way.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from coordinator.observe.timeline import Timeline, write_atomically
from coordinator.status.host import host_facts
from coordinator.status.sources import StatusSources, snapshot

if TYPE_CHECKING:
    from anyio.abc import TaskGroup

    from coordinator.config import Config
    from coordinator.engines.client import EngineClient
    from coordinator.engines.fleet import EngineFleet
    from coordinator.engines.health import FaultInjector, HealthMonitor
    from coordinator.eval.fleet import EvalFleet
    from coordinator.observe.progress import MetricsLog, ProgressDisplay
    from coordinator.status.server import StatusServer
    from coordinator.train.group import TrainGroup
    from coordinator.weights.colocate import Colocation
    from coordinator.weights.sync import WeightSync

log = logging.getLogger("rayless")

FINAL_FILE = "status.json"


class FaultParts(Protocol):
    @property
    def monitors(self) -> Sequence[HealthMonitor]: ...

    @property
    def injector(self) -> FaultInjector | None: ...

    @property
    def eval_fleet(self) -> EvalFleet | None: ...


class RunParts(Protocol):
    """What the status reads of the run's services (`coordinator.services.Services` has these)."""

    @property
    def client(self) -> EngineClient | None: ...

    @property
    def fleet(self) -> EngineFleet | None: ...

    @property
    def eval_engines(self) -> EngineFleet | None: ...

    @property
    def train_group(self) -> TrainGroup | None: ...

    @property
    def weight_sync(self) -> WeightSync | None: ...

    @property
    def colocation(self) -> Colocation | None: ...

    @property
    def ft(self) -> FaultParts: ...


def config_digest(run_dir: Path) -> str:
    """The first 16 hex digits of the SHA-256 of `config.json` (secrets masked), "" before it is written."""
    try:
        return hashlib.sha256((run_dir / "config.json").read_bytes()).hexdigest()[:16]
    except OSError:
        return ""


class RunStatus:
    def __init__(self, config: Config, run_dir: Path, *, progress: ProgressDisplay, metrics: MetricsLog,
                 mask: Callable[[str], str]) -> None:
        self.config = config
        self.timeline = Timeline(run_dir / "timeline.json")
        self.sources = StatusSources(run_dir=run_dir, config_digest=config_digest(run_dir),
                                     progress=progress.run, metrics=metrics, timeline=self.timeline,
                                     board=progress.board, mask=mask, planned=config.rollout.num_rollout)
        self.server: StatusServer | None = None

    async def start(self, parts: RunParts, task_group: TaskGroup) -> StatusServer | None:
        s = self.sources
        s.fleets = [fleet for fleet in (parts.fleet, parts.eval_engines) if fleet is not None]
        s.train_group, s.weight_sync, s.colocation = parts.train_group, parts.weight_sync, parts.colocation
        s.monitors, s.injector, s.eval_fleet = list(parts.ft.monitors), parts.ft.injector, parts.ft.eval_fleet
        settings = self.config.logging
        if not settings.status_port:
            return None
        from coordinator.status.server import StatusServer

        server = StatusServer(s, host=settings.status_host, port=settings.status_port,
                              api_key=self.config.sglang.sglang_api_key)
        self.server = await task_group.start(server.run)
        return self.server

    def finish(self, outcome: str = "finished") -> None:
        """The run is over — `outcome`: "finished", "interrupted" (a stop signal) or "failed" —: the last timeline
        and the last document, each written atomically."""
        s = self.sources
        s.finished = True
        s.outcome = outcome
        try:
            self.timeline.write()
            from coordinator.engines.spec import engine_log_path

            logs = {h.name: engine_log_path(s.run_dir, h.name) for fleet in s.fleets for h in fleet.engines
                    if h.launched}
            document: dict[str, Any] = snapshot(s, host=host_facts(logs, {}))
            write_atomically(s.run_dir / FINAL_FILE, json.dumps(document, default=str) + "\n")
        except OSError as error:  # the run's own outcome matters more than its status files
            log.warning("could not write the run's status files in %s: %s", s.run_dir, error)
