"""`/metrics`: the status document's figures in Prometheus' text format (docs/observability.md lists them).

Owns the metric names and units: every name starts with `rayless_`, counters end in `_total`, durations are in
`_seconds`, sizes in `_bytes`. Rendered with prometheus_client from a registry made for the one request (never
the library's global registry, which would mix in this process's other metrics and keep state between runs).
Invariant: a figure the document does not have (no ETA yet, an engine with no rate) is left out, never 0.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from coordinator.status.sources import ENGINE_STATES
from workers.boundary.json_input import JsonObject

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
#: last row's metrics as gauges: (metrics.jsonl key, name, help)
_LAST_ROW = (
    ("rollout/reward_mean", "rayless_reward_mean", "mean reward of the last rollout"),
    ("rollout/response_len_mean", "rayless_response_length_mean_tokens", "mean response length of the last "
     "rollout, in tokens"),
)
_STEP_PHASES = (("rollout/time_s", "generate"), ("train/time_s", "train"), ("sync/time_s", "weight_sync"))
_HEALTH = (("probes", "rayless_health_probes_total", "health probes sent"),
           ("probe_failures", "rayless_health_probe_failures_total", "health probes that failed"),
           ("deaths", "rayless_engine_deaths_total", "engines declared dead"),
           ("recoveries", "rayless_engine_recoveries_total", "dead engines brought back"),
           ("recovery_errors", "rayless_engine_recovery_errors_total", "relaunches that failed"))


class _Document(Collector):
    def __init__(self, document: JsonObject) -> None:
        self.document = document

    def collect(self) -> Iterator[Metric]:
        d = self.document
        yield from _run(d["run"])
        yield from _engines(d["engines"])
        yield from _ranks(d["ranks"])
        yield from _health(d.get("health", {}))
        yield from _last_row(d["metrics"])


def render(document: JsonObject) -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Document(document))
    return generate_latest(registry)


def _gauge(name: str, doc: str, value: float | None) -> Iterator[Metric]:
    if value is not None:
        yield GaugeMetricFamily(name, doc, value=float(value))


def _run(run: JsonObject) -> Iterator[Metric]:
    yield CounterMetricFamily("rayless_rollouts_completed", "rollouts finished (trained) so far",
                              value=float(run["rollouts_done"]))
    yield from _gauge("rayless_rollouts_planned", "rollouts this run makes (--num-rollout)", run["num_rollout"])
    yield from _gauge("rayless_run_elapsed_seconds", "seconds since the run began", run["elapsed_s"])
    yield from _gauge("rayless_run_eta_seconds", "estimated seconds left", run["eta_s"])
    for key, name, doc in (("train_recoveries", "rayless_train_recoveries", "train steps resent after ranks "
                            "were brought back (train FT)"),
                           ("weight_sync_recoveries", "rayless_weight_sync_recoveries", "dead engines the weight "
                            "sync relaunched before an update")):
        if run.get(key) is not None:
            yield CounterMetricFamily(name, doc, value=float(run[key]))
    yield from _gauge("rayless_loop_lag_seconds", "how late the coordinator's event loop last ran a timer "
                      "(its watchdog's tick)", run.get("loop_lag_s"))
    yield from _gauge("rayless_loop_lag_max_seconds", "the largest event-loop lag of the run",
                      run.get("loop_lag_max_s"))
    if run.get("loop_stalls") is not None:
        yield CounterMetricFamily("rayless_loop_stalls", "times the event loop did not run for more than "
                                  "--loop-stall-warn-s", value=float(run["loop_stalls"]))
    version = run["weight_version"]
    yield from _gauge("rayless_weight_version", "optimizer updates applied to the policy",
                      int(version) if isinstance(version, str) and version.isdigit() else None)


def _engines(engines: list[JsonObject]) -> Iterator[Metric]:
    labels = ["engine", "group"]
    state = GaugeMetricFamily("rayless_engine_state", "1 for the state each engine is in, 0 for the others",
                              labels=[*labels, "state"])
    in_flight = GaugeMetricFamily("rayless_engine_in_flight_requests", "requests the coordinator has open on "
                                  "each engine", labels=labels)
    rate = GaugeMetricFamily("rayless_engine_generation_tokens_per_second", "tokens generated per second, from "
                             "the engine's own counter", labels=labels)
    restarts = CounterMetricFamily("rayless_engine_restarts", "times each engine was started again",
                                   labels=labels)
    for e in engines:
        key = [e["name"], e["group"]]
        for name in ENGINE_STATES:
            state.add_metric([*key, name], 1.0 if e["state"] == name else 0.0)
        in_flight.add_metric(key, float(e["in_flight"]))
        if e["tokens_per_s"] is not None:
            rate.add_metric(key, float(e["tokens_per_s"]))
        restarts.add_metric(key, float(max(0, e["incarnation"] - 1)))
    yield from (state, in_flight, rate, restarts)


def _ranks(ranks: list[JsonObject]) -> Iterator[Metric]:
    up = GaugeMetricFamily("rayless_rank_connected", "1 while the rank is connected to the control channel",
                           labels=["rank"])
    step = GaugeMetricFamily("rayless_rank_last_step_seconds", "the rank's seconds in the last train step",
                             labels=["rank"])
    memory = GaugeMetricFamily("rayless_rank_resident_memory_bytes", "resident memory of the rank's process",
                               labels=["rank"])
    for r in ranks:
        key = [str(r["rank"])]
        up.add_metric(key, 1.0 if r["state"] == "connected" else 0.0)
        if r["last_step_s"] is not None:
            step.add_metric(key, float(r["last_step_s"]))
        if r["memory_bytes"] is not None:
            memory.add_metric(key, float(r["memory_bytes"]))
    if ranks:
        yield from (up, step, memory)


def _health(health: dict[str, dict[str, int]]) -> Iterator[Metric]:
    for key, name, doc in _HEALTH:
        family = CounterMetricFamily(name.removesuffix("_total"), doc, labels=["group"])
        for group, stats in health.items():
            family.add_metric([group], float(stats.get(key, 0)))
        if health:
            yield family


def _last_row(rows: list[JsonObject]) -> Iterator[Metric]:
    if not rows:
        return
    last = rows[-1]
    for key, name, doc in _LAST_ROW:
        value = last.get(key)
        yield from _gauge(name, doc, value if isinstance(value, int | float) else None)
    phases = GaugeMetricFamily("rayless_step_phase_seconds", "seconds of each phase of the last step",
                               labels=["phase"])
    for key, phase in _STEP_PHASES:
        if isinstance(last.get(key), int | float):
            phases.add_metric([phase], float(last[key]))
    yield phases
