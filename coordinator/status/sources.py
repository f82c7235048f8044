"""What the status server reads, and the one JSON document (`/status`) it makes of it.

Owns `StatusSources` (references to the run's live objects, each None where the mode has none), `Changes`
(the engines' recent state changes, recorded by a watcher of each fleet) and `snapshot()`. Invariants: a
snapshot is built in one go between two awaits (the event loop's thread; no lock, nothing awaited), reads only
public fields, and does bounded work — the last `RECENT_ROWS` metrics rows, `RECENT_EVENTS` health events, the
timeline's last `TIMELINE_S` seconds (at most `TIMELINE_EVENTS`). Reading files (engine log tails) and the
ranks' memory is `host_facts`' business, run in a worker thread. Nothing here holds a secret: the engines' log
lines pass through the run's mask.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from workers.boundary.json_input import JsonObject

if TYPE_CHECKING:
    from coordinator.engines.fleet import EngineFleet, EngineHandle
    from coordinator.engines.health import FaultInjector, HealthMonitor
    from coordinator.eval.fleet import EvalFleet
    from coordinator.observe.progress import MetricsLog, RunProgress
    from coordinator.observe.startup import StartupBoard
    from coordinator.observe.timeline import Timeline
    from coordinator.observe.watchdog import LagStats
    from coordinator.train.group import TrainGroup
    from coordinator.weights.colocate import Colocation
    from coordinator.weights.sync import WeightSync

RECENT_ROWS = 500
RECENT_EVENTS = 50
TIMELINE_S = 30.0
TIMELINE_EVENTS = 1500
CHANGES_PER_ENGINE = 12
#: the engine states the status document names (the fleet's three, told apart by incarnation and colocation)
ENGINE_STATES = ("starting", "healthy", "released", "dead", "relaunching", "stopped")


def engine_state(handle: EngineHandle, released: frozenset[str], *, finished: bool = False) -> str:
    state = handle.state.value
    if finished and state == "dead" and handle.launched:
        return "stopped"  # the fleet stops every engine it launched when the run ends
    if state == "alive":
        return "released" if handle.name in released else "healthy"
    if state == "starting":
        return "relaunching" if handle.incarnation > 0 else "starting"
    return "dead"


class Changes:
    """Each engine's last state changes as (wall time, state), kept by `watch` (one task per fleet)."""

    def __init__(self) -> None:
        self.by_engine: dict[str, deque[tuple[float, str]]] = {}

    def note(self, name: str, state: str) -> None:
        seen = self.by_engine.setdefault(name, deque(maxlen=CHANGES_PER_ENGINE))
        if not seen or seen[-1][1] != state:
            seen.append((time.time(), state))

    async def watch(self, fleet: EngineFleet, released: Callable[[], frozenset[str]]) -> None:
        """Until cancelled: note every engine's state after each change of the fleet (a change sets its event;
        the states between two wake-ups that lasted no await are not seen — none of the fleet's does)."""
        while True:
            now_released = released()
            for handle in fleet.engines:
                self.note(handle.name, engine_state(handle, now_released))
            await fleet.wait_changed()


@dataclass
class StatusSources:
    """The run's live objects the status document is made from (None where the mode has none)."""

    run_dir: Path
    config_digest: str
    progress: RunProgress
    metrics: MetricsLog
    timeline: Timeline
    board: StartupBoard | None = None
    fleets: list[EngineFleet] = field(default_factory=list)
    train_group: TrainGroup | None = None
    weight_sync: WeightSync | None = None
    colocation: Colocation | None = None
    monitors: list[HealthMonitor] = field(default_factory=list)
    injector: FaultInjector | None = None
    eval_fleet: EvalFleet | None = None
    changes: Changes = field(default_factory=Changes)
    #: the coordinator's event-loop lag (`LoopWatchdog.stats`)
    loop: LagStats | None = None
    #: the run's secret mask (`coordinator.config.secrets.mask_text` over the config's secrets)
    mask: Callable[[str], str] = lambda text: text
    finished: bool = False
    #: how the run ended once `finished`: "finished", "interrupted" or "failed"
    outcome: str = "finished"
    #: the rollouts the run makes (`--num-rollout`), known before the loop starts (None: replay counts dumps)
    planned: int | None = None

    def released(self) -> frozenset[str]:
        return self.colocation.released_engines() if self.colocation is not None else frozenset()


def snapshot(s: StatusSources, *, host: JsonObject | None = None) -> JsonObject:
    """The `/status` document. `host`: `host_facts`' result."""
    host = host or {}
    return {
        "run": _run(s),
        "engines": _engines(s, engine_rates(s.metrics.last), host.get("log_lines", {})),
        "ranks": _ranks(s, host.get("rank_memory", {})),
        "eval": _eval(s),
        "events": _events(s),
        "health": {m.group: dataclasses.asdict(m.stats) for m in s.monitors},
        "metrics": _metrics(s),
        "timeline": _timeline(s),
    }


def _run(s: StatusSources) -> JsonObject:
    p, t = s.progress, s.timeline
    eta = p.eta()
    return {
        "run_dir": str(s.run_dir), "config_digest": s.config_digest,
        "state": s.outcome if s.finished else ("running" if p.total else "starting"),
        # a run stopped in start-up still says what it was to make
        "rollouts_done": p.first + p.done, "num_rollout": p.total or s.planned,
        "elapsed_s": time.monotonic() - p.started,
        "eta_s": None if s.finished else eta, "rollout_id": t.rollout_id,
        "weight_version": s.weight_sync.current_version if s.weight_sync is not None
        and s.weight_sync.current_version is not None else t.weight_version,
        "phase": p.phase or t.phase_now() or (s.outcome if s.finished else ""),
        "train_recoveries": s.train_group.recoveries if s.train_group is not None else None,
        "weight_sync_recoveries": s.weight_sync.recoveries if s.weight_sync is not None else None,
        "loop_lag_s": s.loop.last_s if s.loop is not None else None,
        "loop_lag_max_s": s.loop.max_s if s.loop is not None else None,
        "loop_stalls": s.loop.stalls if s.loop is not None else None,
    }


def engine_rates(row: JsonObject) -> dict[str, float]:
    """Each engine's tokens/s in the last rollout, from the metrics row the run logged (one source: the same
    figures as `metrics.jsonl`'s `rollout/tokens_per_s/<engine>`, which add up to the terminal's rate)."""
    from coordinator.observe.progress import ENGINE_RATE_PREFIX

    return {key[len(ENGINE_RATE_PREFIX):]: float(value) for key, value in row.items()
            if key.startswith(ENGINE_RATE_PREFIX) and isinstance(value, int | float)}


def _engines(s: StatusSources, rates: dict[str, float], log_lines: dict[str, str]) -> list[JsonObject]:
    released = s.released()
    where = {row.name: row.where for row in s.board.rows()} if s.board is not None else {}
    rows = []
    for fleet in s.fleets:
        version = _fleet_version(s, fleet)
        for h in fleet.engines:
            state = engine_state(h, released, finished=s.finished)
            rows.append({
                "name": h.name, "group": fleet.group, "address": h.url, "where": where.get(h.name, ""),
                "node": h.node, "tp_size": h.tp_size, "state": state, "in_flight": h.in_flight,
                "incarnation": h.incarnation, "weight_version": version if state == "healthy" else None,
                "tokens_per_s": rates.get(h.name), "dead_reason": s.mask(h.dead_reason or "") or None,
                "log_line": s.mask(log_lines.get(h.name, "")),
                "changes": [{"at": at, "state": st} for at, st in s.changes.by_engine.get(h.name, ())],
            })
    return rows


def _fleet_version(s: StatusSources, fleet: EngineFleet) -> str | None:
    if fleet.group == "eval":
        ev = s.eval_fleet
        if ev is None:
            return None
        job = ev.running
        if job is not None:
            return job.weight_version
        done = [r for r in ev.records[-RECENT_EVENTS:] if r.status == "done"]
        return done[-1].weight_version if done else None
    if s.weight_sync is not None and s.weight_sync.current_version is not None:
        return s.weight_sync.current_version
    return "0" if s.weight_sync is not None else None


def _ranks(s: StatusSources, memory: dict[int, int]) -> list[JsonObject]:
    g = s.train_group
    if g is None:
        return []
    connected = g.ranks
    steps = g.commands.rank_step_s
    rows = []
    for rank in range(g.world_size):
        info = connected.get(rank)
        rows.append({
            "rank": rank, "node": info.node_rank if info is not None else None,
            "pid": info.pid if info is not None else None,
            "state": "finished" if s.finished else ("connected" if info is not None else "down"),
            "restarts": info.restart_count if info is not None else None,
            "last_step_s": steps[rank] if rank < len(steps) else None,
            "memory_bytes": memory.get(rank),
        })
    return rows


def _eval(s: StatusSources) -> JsonObject | None:
    ev = s.eval_fleet
    if ev is None:
        return None
    job = ev.running
    return {
        "running": {"eval_id": job.eval_id, "pinned_step": job.pinned_step, "weight_version": job.weight_version}
        if job is not None else None,
        "waiting": len(ev.waiting),
        "records": [{"eval_id": r.eval_id, "pinned_step": r.pinned_step, "weight_version": r.weight_version,
                     "status": r.status, "reason": r.reason, "lag_steps": r.lag_steps,
                     "duration_s": r.duration_s, "metrics": dict(r.metrics)} for r in ev.records[-10:]],
    }


def _events(s: StatusSources) -> list[JsonObject]:
    """Failures and recoveries, newest last: the monitors' health events and the fault injector's kills."""
    now_wall, now = time.time(), time.monotonic()
    events = [{"at": now_wall - (now - e.at), "group": m.group, "engine": e.engine, "kind": e.kind,
               "detail": s.mask(e.detail)[:300]} for m in s.monitors for e in m.events[-RECENT_EVENTS:]]
    if s.injector is not None:
        events += [{"at": None, "group": "rollout", "engine": name, "kind": "fault injected",
                    "detail": f"--inject-engine-fault-at-rollout {s.injector.at_rollout}"}
                   for name in s.injector.killed]
    events.sort(key=lambda e: e["at"] if e["at"] is not None else 0.0)
    return events[-RECENT_EVENTS:]


def _metrics(s: StatusSources) -> list[JsonObject]:
    return [dict(row) for row in s.metrics.history[-RECENT_ROWS:]]


def _timeline(s: StatusSources) -> list[JsonObject]:
    events = [e for e in s.timeline.recent(TIMELINE_S) if e["ph"] == "X"]
    return events[-TIMELINE_EVENTS:]
