"""The status pieces on their own: the timeline recorder, the Prometheus rendering (read back by Prometheus' own
parser), the flags, and `rayless status` on directories that are not (or no longer) readable runs."""

from __future__ import annotations

import contextlib
import io
import json
import os
import socket
import subprocess
import sys
from collections import Counter
from pathlib import Path

import anyio
import pytest
from prometheus_client.parser import text_string_to_metric_families

from coordinator.config import ConfigError, parse_config
from coordinator.observe import timeline
from coordinator.observe.progress import MetricsLog, RunProgress
from coordinator.observe.timeline import Timeline, recording
from coordinator.status import command, prometheus, reading
from coordinator.status.sources import StatusSources, snapshot
from replay.format import write_dump
from replay.sample import Sample, SampleStatus


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
    assert reading.check_shape(json.loads(json.dumps(document)), "/status")  # what `rayless status` accepts


def test_an_engines_rate_is_read_from_the_rollouts_row_on_the_page_and_metrics_alike(tmp_path: Path) -> None:
    """One source: the rollout's per-engine share (what `coordinator.rollout.generate.engine_rates` logs), the
    same number in `/status` and `/metrics`; an engine without a figure in the row has none in either."""
    from coordinator.engines.client import EngineClient
    from coordinator.engines.fleet import EngineFleet
    from coordinator.rollout.generate import engine_rates

    fleet = EngineFleet(client=EngineClient(max_connections=1), external_urls=["127.0.0.1:1", "127.0.0.1:2"],
                        run_dir=tmp_path)
    first, second = fleet.engines
    shares = engine_rates(Counter({first.url: 300, "http://127.0.0.1:9": 100}), fleet, 2.0)  # :9: no engine's
    assert shares == {f"rollout/tokens_per_s/{first.name}": 150.0}
    metrics = MetricsLog(tmp_path)
    metrics.log(0, {"rollout/tokens_per_s": 200.0, **shares})
    metrics.close()
    sources = StatusSources(run_dir=tmp_path, config_digest="abc", progress=RunProgress(), metrics=metrics,
                            timeline=Timeline(None), fleets=[fleet])
    document = snapshot(sources)
    assert [(e["name"], e["tokens_per_s"]) for e in document["engines"]] == [(first.name, 150.0),
                                                                             (second.name, None)]
    rates = {s.labels["engine"]: s.value for family in text_string_to_metric_families(prometheus.render(document)
                                                                                        .decode())
             for s in family.samples if s.name == "rayless_engine_generation_tokens_per_second"}
    assert rates == {first.name: 150.0}


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


def test_the_eta_is_shown_while_the_run_goes_on_and_not_once_it_ended(tmp_path: Path) -> None:
    progress = RunProgress()
    progress.begin(0, 8)
    progress.rollout_done(0)
    metrics = MetricsLog(tmp_path)
    metrics.close()
    sources = StatusSources(run_dir=tmp_path, config_digest="", progress=progress, metrics=metrics,
                            timeline=Timeline(None))
    assert " · ETA 0:" in command.render(snapshot(sources), "test").splitlines()[0]  # running: 7 rollouts to go
    for outcome in ("finished", "interrupted", "failed"):
        sources.finished, sources.outcome = True, outcome
        first = command.render(snapshot(sources), "test").splitlines()[0]
        assert first.startswith(f"run {tmp_path}: {outcome} · 1/8 rollouts · elapsed ") and "ETA" not in first


def test_an_evaluations_rows_stay_out_of_the_rollouts_and_show_as_evaluations(tmp_path: Path) -> None:
    """An evaluation writes its own row at its rollout's step (on the rollout engines, or the fleet's, skipped or
    done). The page's recent rollouts, `/metrics`' latest figures and the engines' rates read the rollouts' rows
    only (after an evaluation they went blank); `rayless status` lists the evaluations in a table of their own."""
    metrics = MetricsLog(tmp_path)
    rollout = {"rollout/reward_mean": 0.5, "rollout/response_len_mean": 4.0, "rollout/time_s": 1.0,
               "train/time_s": 2.0, "sync/time_s": 0.1, "rollout/tokens_per_s/rollout-0": 40.0}
    metrics.log(0, {"eval/step": 0, "eval/weight_version": "0", "eval/digits/reward_mean": 0.25})
    metrics.log(0, rollout)
    metrics.log(1, {**rollout, "rollout/reward_mean": 0.75})
    metrics.log(1, {"eval/skipped": 1.0, "eval/skipped_busy": 1.0, "eval/skip_reason": "busy",
                    "eval/weight_version": "2"})
    metrics.close()
    assert [row["rollout/reward_mean"] for row in metrics.history] == [0.5, 0.75]
    assert metrics.last["rollout/reward_mean"] == 0.75 and "rollout/tokens_per_s/rollout-0" in metrics.last
    sources = StatusSources(run_dir=tmp_path, config_digest="", progress=RunProgress(), metrics=metrics,
                            timeline=Timeline(None))
    document = snapshot(sources)
    assert [row["step"] for row in document["metrics"]] == [0, 1]
    families = {family.name: family for family in text_string_to_metric_families(prometheus.render(document).decode())}
    assert families["rayless_reward_mean"].samples[0].value == 0.75

    (tmp_path / "config.json").write_text(json.dumps({"num_rollout": 2}))  # no status.json: read from the files
    code, text = run_status([str(tmp_path)])
    rollouts = text[text.index("last rollouts:"):text.index("last evaluations:")].splitlines()
    assert code == 0 and len(rollouts) == 4 and all(" - " not in line for line in rollouts)
    evaluations = text[text.index("last evaluations:"):].splitlines()
    assert evaluations[2].split() == ["0", "0", "digits", "0.250"]
    assert evaluations[3].split()[:3] == ["1", "2", "skipped:"] and "busy" in evaluations[3]


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
    # beyond loopback: only with the run's key (every client is asked for it) or the explicit flag
    for host in ("0.0.0.0", "::", "10.1.2.3"):
        with pytest.raises(ConfigError, match=r"--status-host .* --sglang-api-key KEY .* --allow-unauthenticated"):
            parse_config([*base, "--status-port", "8265", "--status-host", host])
    assert parse_config([*base, "--status-port", "8265", "--status-host", "127.0.0.2"]).logging.status_host
    assert parse_config([*base, "--status-port", "8265", "--status-host", "0.0.0.0", "--sglang-api-key", "k"])
    assert parse_config([*base, "--status-port", "8265", "--status-host", "0.0.0.0", "--allow-unauthenticated"])
    with pytest.raises(ConfigError, match=r"--session-server-ip 0\.0\.0\.0 .*--allow-unauthenticated"):
        parse_config([*base, "--use-session-server", "--session-server-ip", "0.0.0.0",
                      "--custom-agent-function-path", "a:b", "--custom-generate-function-path",
                      "miles.rollout.generate_hub.agentic_tool_call.generate"])
    # a key is an HTTP header's value: a non-ASCII one is refused here, not by the HTTP client mid-run
    with pytest.raises(ConfigError, match="--sglang-api-key: '\\*\\*\\*' has a character that is not printable "
                       "ASCII") as refused:
        parse_config([*base, "--sglang-api-key", "clé-secrète"])
    assert "clé" not in str(refused.value)


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


@pytest.mark.parametrize("argv", [["status", "RUN"], ["--help"],
                                  ["reward", "score", "--rm-type", "exact_match", "RUN/rows.jsonl"],
                                  ["dump", "show", "RUN/0.rld"]])
def test_a_reader_that_stops_reading_ends_the_command_quietly(tmp_path: Path, argv: list[str]) -> None:
    """`rayless status RUN | head -1`: the reader is gone before the command writes (its end of the pipe closed
    at once), so every write meets EPIPE; the command exits 0 with no BrokenPipeError traceback."""
    (tmp_path / "config.json").write_text(json.dumps({"num_rollout": 4}))
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 0, "rollout/reward_mean": 0.5}) + "\n")
    # more output than a pipe's buffer: the write that meets EPIPE happens inside the command, not at exit
    (tmp_path / "rows.jsonl").write_text((json.dumps({"response": "a", "label": "a"}) + "\n") * 5000)
    write_dump(tmp_path / "0.rld", 0, [Sample(tokens=[1, 2], response_length=1, loss_mask=[1], rollout_log_probs=[-1.0],
                                              status=SampleStatus.COMPLETED, reward=1.0, response="x")],
               config_facts={})
    argv = [arg.replace("RUN", str(tmp_path)) for arg in argv]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    child = subprocess.Popen([sys.executable, "-m", "coordinator.cli", *argv], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, env=env)
    assert child.stdout is not None
    child.stdout.close()  # the only reader: from here on a write to the child's stdout is EPIPE
    _, err = child.communicate(timeout=60)
    assert child.returncode == 0, err.decode()
    assert b"Traceback" not in err and b"BrokenPipeError" not in err and b"Broken pipe" not in err


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


class HostileStatusServer:
    """A real local HTTP server (a thread of this process) whose `/status` misbehaves by path: `/huge` streams
    2 GiB without declaring a length (1 MiB at a time, until the client hangs up), `/declared` declares 2 GiB,
    `/doc/N` answers document N of `DOCUMENTS`."""

    HUGE = 2 << 30

    def __init__(self, documents: list[bytes]) -> None:
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        chunk = b" " * (1 << 20)
        self.sent = 0

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.0"

            def log_message(self, *args: object) -> None:
                pass

            def do_GET(handler) -> None:
                if handler.path == "/huge/status":
                    handler.send_response(200)
                    handler.send_header("Content-Type", "application/json")
                    handler.end_headers()
                    try:
                        while self.sent < self.HUGE:
                            handler.wfile.write(chunk)
                            self.sent += len(chunk)
                    except OSError:
                        return  # the client hung up: what it should do
                elif handler.path == "/declared/status":
                    handler.send_response(200)
                    handler.send_header("Content-Length", str(self.HUGE))
                    handler.end_headers()
                else:
                    body = documents[int(handler.path.split("/")[2])]
                    handler.send_response(200)
                    handler.send_header("Content-Length", str(len(body)))
                    handler.end_headers()
                    handler.wfile.write(body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> HostileStatusServer:
        import threading

        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


RUN = {"run_dir": "/r", "config_digest": "", "state": "running", "rollouts_done": 1, "num_rollout": 4,
       "elapsed_s": 3.0, "eta_s": None, "weight_version": "1", "phase": "train"}
MALFORMED = [
    (b"[1, 2]", "not a rayless status document (a JSON list"),
    (b'{"run": 5}', "run is int, not an object"),
    (json.dumps({"run": {**RUN, "rollouts_done": "x"}}).encode(), "run.rollouts_done is str"),
    (json.dumps({"run": {k: v for k, v in RUN.items() if k != "state"}}).encode(), "run has no 'state'"),
    (json.dumps({"run": RUN, "engines": {"a": 1}}).encode(), "engines is dict, not a list"),
    (json.dumps({"run": RUN, "engines": [{"name": "e"}]}).encode(), "engines[0] has no 'state'"),
    (json.dumps({"run": RUN, "ranks": [{"rank": True, "node": 0, "state": "x"}]}).encode(), "ranks[0].rank is bool"),
    (b'{"run": ' * 100_000, "nested deeper than"),
    (b"\xff\xfe not json", "/status"),
]


def test_rayless_status_reads_a_hostile_server_under_a_cap_and_prints_no_control_character() -> None:
    from tests.support.memory import PeakMemory

    hostile_text = json.dumps({"run": {**RUN, "state": "\x1b[2J\x1b[31mrunning\r\x07", "phase": "\u202etrain"},
                               "engines": [{"name": "e\x1b]0;owned\x07", "state": "healthy", "address": None,
                                            "in_flight": 0, "log_line": "ok\x1b[1A\x00"}]}).encode()
    documents = [document for document, _ in MALFORMED] + [hostile_text]
    with HostileStatusServer(documents) as server:
        peak = PeakMemory()
        code, text = run_status(["--url", f"{server.url}/huge"])
        assert code == 1 and "more than the 16 MiB a status document may have" in text, text
        assert peak.growth_mib < 100, f"{peak.growth_mib:.0f} MiB for a 2 GiB reply"
        assert server.sent < HostileStatusServer.HUGE, "the client hung up rather than read it all"
        code, text = run_status(["--url", f"{server.url}/declared"])
        assert code == 1 and f"declares {HostileStatusServer.HUGE} bytes" in text, text
        for index, (_, expected) in enumerate(MALFORMED):
            code, text = run_status(["--url", f"{server.url}/doc/{index}"])
            assert code == 1 and expected in text and "Traceback" not in text, (index, text)
        code, text = run_status(["--url", f"{server.url}/doc/{len(MALFORMED)}"])
        assert code == 0 and "running" in text and "train" in text, text
        assert not any((ord(c) < 32 and c != "\n") or 0x7F <= ord(c) < 0xA0 or c == "\u202e" for c in text), repr(text)
        code, text = run_status(["--url", f"{server.url}/doc/{len(MALFORMED)}", "--json"])
        assert code == 0 and "\x1b" not in text and "\\u001b" not in text
    assert peak.growth_mib < 100


@pytest.mark.parametrize("url", ["not a url", "ftp://127.0.0.1:1", "http://", "http://127.0.0.1:99999",
                                 "http://127.0.0.1:1/\x1b[2J", "x" * 10_000])
def test_a_garbage_status_url_is_a_clear_error(tmp_path: Path, url: str) -> None:
    code, text = run_status(["--url", url])
    assert code == 1 and "is not a status server's address (expected http://HOST:PORT)" in text, text
    assert "\x1b" not in text and len(text) < 400
    (tmp_path / "config.json").write_text("{}")  # a run directory whose status_url is garbage: the files speak
    (tmp_path / "status_url").write_text(url)
    code, text = run_status([str(tmp_path)])
    assert code == 0 and "not a status server's address" in text


def test_a_non_ascii_api_key_is_refused_before_any_request() -> None:
    with pytest.raises(SystemExit) as exited:
        run_status(["--url", "http://127.0.0.1:9", "--api-key", "clé"])
    assert exited.value.code == 2
