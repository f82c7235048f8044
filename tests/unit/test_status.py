"""The status pieces on their own: the timeline recorder, the Prometheus rendering (read back by Prometheus' own
parser), the flags, and `rayless status` on directories that are not (or no longer) readable runs."""

from __future__ import annotations

import contextlib
import io
import json
import socket
from pathlib import Path

import anyio
import pytest
from prometheus_client.parser import text_string_to_metric_families

from coordinator.config import ConfigError, parse_config
from coordinator.observe import timeline
from coordinator.observe.progress import MetricsLog, RunProgress
from coordinator.observe.timeline import Timeline, recording
from coordinator.status import command, prometheus
from coordinator.status.sources import StatusSources, snapshot


def test_spans_nest_concurrent_ones_get_lanes_and_the_file_is_trace_events(tmp_path: Path) -> None:
    recorder = Timeline(tmp_path / "timeline.json")

    async def main() -> None:
        async def group(index: int) -> None:
            with timeline.span("reward", ("rollout", None), group=index):
                await anyio.sleep(0.01)

        with recording(recorder):
            timeline.at_step(7, "3")
            with timeline.span("generate"):
                async with anyio.create_task_group() as tg:
                    for index in range(3):
                        tg.start_soon(group, index)
            with pytest.raises(RuntimeError), timeline.span("train"):
                raise RuntimeError("a rank died")

    anyio.run(main)
    assert timeline.current() is None
    recorder.write()
    events = json.loads((tmp_path / "timeline.json").read_text())["traceEvents"]
    timed = [e for e in events if e["ph"] == "X"]
    assert [e["name"] for e in timed if e["name"] != "reward"] == ["generate", "train"]
    assert all(e["args"]["rollout_id"] == 7 and e["args"]["weight_version"] == "3" for e in timed)
    assert next(e for e in timed if e["name"] == "train")["args"]["error"] == "RuntimeError"
    rewards = [e for e in timed if e["name"] == "reward"]
    assert len({e["tid"] for e in rewards}) == 3, "three groups at once: three lanes, none overlapping on a row"
    generate = next(e for e in timed if e["name"] == "generate")
    assert all(generate["ts"] <= e["ts"] and e["ts"] + e["dur"] <= generate["ts"] + generate["dur"] + 1
               for e in rewards)
    rows = {e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert {"phases", "lane 0", "lane 1", "lane 2"} <= rows


def test_the_timeline_keeps_a_bounded_number_of_events_per_group() -> None:
    recorder = Timeline(None, max_events_per_group=50)
    for index in range(500):
        recorder.complete("health probe", recorder.origin + index, 0.5, ("health", "rollout-0"))
        recorder.complete("step", recorder.origin + index, 1.0, timeline.STEPS)
    kept = [e for e in recorder.events() if e["ph"] == "X"]
    assert len(kept) == 100 and recorder.dropped == 900
    assert min(e["ts"] for e in kept if e["name"] == "step") == 450 * 1e6, "the oldest are dropped first"


def test_metrics_parse_as_prometheus_text_with_conventional_names(tmp_path: Path) -> None:
    progress = RunProgress()
    progress.begin(0, 8)
    progress.rollout_done(2)
    metrics = MetricsLog(tmp_path)
    metrics.log(2, {"rollout/reward_mean": 0.25, "rollout/response_len_mean": 7.5, "train/time_s": 0.3})
    metrics.close()
    recorder = Timeline(None)
    recorder.at_step(2, "2")
    sources = StatusSources(run_dir=tmp_path, config_digest="abc", progress=progress, metrics=metrics,
                            timeline=recorder)
    document = snapshot(sources)
    samples = {s.name: s for family in text_string_to_metric_families(prometheus.render(document).decode())
               for s in family.samples}
    assert samples["rayless_rollouts_completed_total"].value == 3
    assert samples["rayless_rollouts_planned"].value == 8
    assert samples["rayless_weight_version"].value == 2
    assert samples["rayless_reward_mean"].value == 0.25
    assert samples["rayless_step_phase_seconds"].labels == {"phase": "train"}
    assert samples["rayless_run_elapsed_seconds"].value >= 0
    assert all(name.startswith("rayless_") for name in samples)
    assert json.loads(json.dumps(document))["run"]["rollouts_done"] == 3


def test_a_run_stopped_in_start_up_says_so_and_keeps_its_planned_rollouts(tmp_path: Path) -> None:
    metrics = MetricsLog(tmp_path)
    metrics.close()
    sources = StatusSources(run_dir=tmp_path, config_digest="", progress=RunProgress(), metrics=metrics,
                            timeline=Timeline(None), planned=60)
    sources.finished, sources.outcome = True, "interrupted"  # what RunStatus.finish records after a signal
    run = snapshot(sources)["run"]
    assert (run["state"], run["rollouts_done"], run["num_rollout"], run["eta_s"]) == ("interrupted", 0, 60, None)
    # without status.json, summary.json's outcome speaks: a run stopped by a signal is not "finished"
    (tmp_path / "config.json").write_text(json.dumps({"num_rollout": 60}))
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 0}) + "\n")
    (tmp_path / "summary.json").write_text(json.dumps({"rollouts": 1, "outcome": "interrupted"}))
    code, text = run_status([str(tmp_path)])
    assert code == 0 and f"run {tmp_path}: interrupted · 1/60 rollouts" in text


def test_status_flags_are_checked_at_start_up() -> None:
    base = ["--hf-checkpoint", "/model", "--prompt-data", "builtin:first_digit", "--rollout-num-engines", "1",
            "--num-rollout", "2", "--rollout-batch-size", "4", "--n-samples-per-prompt", "2"]
    with pytest.raises(ConfigError, match="--status-port"):
        parse_config([*base, "--status-host", "0.0.0.0"])
    with pytest.raises(ConfigError, match="--status-port"):
        parse_config([*base, "--status-port", "70000"])
    with pytest.raises(ConfigError, match="--status-host"):
        parse_config([*base, "--status-port", "8265", "--status-host", "not a host"])
    assert parse_config([*base, "--status-port", "8265"]).logging.status_host == "127.0.0.1"


def run_status(argv: list[str]) -> tuple[int, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = command.main(argv)
    return code, out.getvalue() + err.getvalue()


def test_rayless_status_names_what_it_cannot_read(tmp_path: Path) -> None:
    code, text = run_status([str(tmp_path / "missing")])
    assert code == 1 and "no such run directory" in text
    code, text = run_status([str(tmp_path)])
    assert code == 1 and "not a run directory" in text
    (tmp_path / "status.json").write_text("[" * 1000)
    code, text = run_status([str(tmp_path)])
    assert code == 1 and "status.json" in text
    (tmp_path / "status_url").write_text("http://127.0.0.1:9\n")  # a server that is gone: the files speak
    (tmp_path / "status.json").unlink()
    (tmp_path / "config.json").write_text(json.dumps({"num_rollout": 4}))
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 0, "rollout/reward_mean": 0.5}) + "\n")
    code, text = run_status([str(tmp_path)])
    assert code == 0 and "1/4 rollouts" in text and "does not answer" in text and "0.500" in text


def test_a_status_port_in_use_stops_the_run_before_anything_launches(tiny_model_dir: Path, tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    from coordinator.cli import train_main

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        code = train_main(["--hf-checkpoint", str(tiny_model_dir), "--prompt-data", "builtin:first_digit",
                           "--rollout-num-engines", "1", "--num-rollout", "1", "--rollout-batch-size", "1",
                           "--n-samples-per-prompt", "1", "--run-dir", str(tmp_path / "run"),
                           "--status-port", str(port)])
    assert code == 2
    assert f"--status-port {port}: 127.0.0.1:{port} is in use" in capsys.readouterr().err
    assert not (tmp_path / "run").exists(), "nothing was launched or written"


def test_engine_states_as_the_status_names_them() -> None:
    from coordinator.engines.fleet import EngineHandle, EngineState
    from coordinator.status.sources import engine_state

    def handle(state: EngineState, incarnation: int) -> EngineHandle:
        return EngineHandle(name="rollout-0", url="http://127.0.0.1:1", launched=True, state=state,
                            incarnation=incarnation)

    nothing: frozenset[str] = frozenset()
    assert engine_state(handle(EngineState.STARTING, 0), nothing) == "starting"
    assert engine_state(handle(EngineState.ALIVE, 1), nothing) == "healthy"
    assert engine_state(handle(EngineState.ALIVE, 1), frozenset({"rollout-0"})) == "released"
    assert engine_state(handle(EngineState.DEAD, 1), nothing) == "dead"
    assert engine_state(handle(EngineState.STARTING, 1), nothing) == "relaunching"
    assert engine_state(handle(EngineState.DEAD, 2), nothing, finished=True) == "stopped"
