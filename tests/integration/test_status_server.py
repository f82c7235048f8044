"""The status server during a real CPU run (two engines, rollout FT, the fault injector killing one at rollout 2,
an API key), watched the way a person would: the page in Debian's Chromium (headless, driven through
Playwright), `/metrics` read by Prometheus' own parser, `rayless status` on the running and on the finished
run, and `timeline.json` checked as Chrome trace events that account for each step's wall time.

Chromium: `.ci/run` installs it; under CI=true a missing browser fails this test, elsewhere it skips.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from coordinator.config import parse_config
from coordinator.run import run_training
from coordinator.services import Services
from coordinator.status import command
from tests.support.engine_proc import free_port
from tests.support.waiting import wait_until

KEY = "SENTINEL-STATUS-KEY"
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
ROLLOUTS = 5
#: the victim's table row, as the page draws it: [state, recent states]
ROW_JS = """name => { const row = document.querySelector(`#engines tr[data-engine="${name}"]`);
  return row ? [row.querySelector('.state').textContent, row.querySelector('.changes').textContent] : null; }"""
BOTH_HEALTHY_JS = """() => { const cells = [...document.querySelectorAll('#engines tbody .state')];
  return cells.length === 2 && cells.every(c => c.textContent === 'healthy'); }"""


def chromium() -> str:
    if shutil.which(CHROMIUM) is None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"{CHROMIUM} is missing: .ci/run installs Debian's chromium before the tests")
        pytest.skip(f"{CHROMIUM} is not installed (apt-get install chromium)")
    return CHROMIUM


def status_text(argv: list[str]) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = command.main(argv)
    return code, out.getvalue()


class Probe:
    """Training-loop hook: at rollout 3 reads the server as a client would; at the last rollout waits until the
    page has shown the recovery, then takes the screenshot."""

    def __init__(self, run_dir: Path, url: str, page: Any, recovered: anyio.Event) -> None:
        self.run_dir, self.url, self.page, self.recovered = run_dir, url, page, recovered
        self.metrics: dict[str, Any] = {}
        self.engine_rates: dict[str, float] = {}
        self.unauthorised: int | None = None
        self.running_text = ""
        self.stacks: tuple[int, str, str] = (-1, "", "")

    async def after_step(self, rollout_id: int, weight_version: str) -> None:
        if rollout_id == 3:
            async with httpx.AsyncClient(timeout=30) as client:
                self.unauthorised = (await client.get(f"{self.url}/status")).status_code
                # a document is up to the server's min_interval old: ask until it shows this step (the loop
                # waits on this hook, so rollout 4 cannot be counted meanwhile)
                async def metrics() -> dict[str, Any]:
                    text = (await client.get(f"{self.url}/metrics")).text
                    return {s.name: s for family in text_string_to_metric_families(text) for s in family.samples
                            if not s.labels or (s.name == "rayless_engine_state" and s.value == 1.0)}

                self.metrics = await wait_until(
                    metrics, what="/metrics counting rollout 3", timeout=30, interval=0.1,
                    until=lambda seen: seen["rayless_rollouts_completed_total"].value >= 4)
                text = (await client.get(f"{self.url}/metrics")).text
                self.engine_rates = {s.labels["engine"]: s.value for family in text_string_to_metric_families(text)
                                     for s in family.samples if s.name == "rayless_engine_generation_tokens_per_second"}
            code, self.running_text = await anyio.to_thread.run_sync(
                status_text, [str(self.run_dir), "--api-key", KEY])
            assert code == 0, self.running_text
            # `rayless stacks` as a user runs it, while the loop waits on this hook
            stacks = await anyio.run_process([sys.executable, "-m", "coordinator.cli", "stacks",
                                              str(self.run_dir)], check=False)
            self.stacks = (stacks.returncode, stacks.stdout.decode(), stacks.stderr.decode())
        if rollout_id == ROLLOUTS - 1:
            with anyio.fail_after(240):
                await self.recovered.wait()
            await self.page.wait_for_function(  # the page has drawn the run's last rollout
                f"() => document.getElementById('run').textContent.includes('{ROLLOUTS}/{ROLLOUTS} rollouts')",
                timeout=60_000)
            await self.page.screenshot(path=str(self.run_dir / "status_page.png"), full_page=True)


async def watch_page(page: Any, url: str, recovered: anyio.Event, seen: list[list[str]]) -> None:
    """The page, polling /status 5 times a second: both engines healthy; the victim dead, then relaunching
    (each in its state cell or in its recent states); then both healthy again."""

    async def answers() -> bool:
        try:
            async with httpx.AsyncClient(timeout=5) as client:
                return (await client.get(f"{url}/status", headers={"Authorization": f"Bearer {KEY}"})).is_success
        except httpx.HTTPError:
            return False

    await wait_until(answers, what="the status server", timeout=300, interval=0.2)
    await page.goto(f"{url}/?poll=200#key={KEY}")
    await page.wait_for_function(BOTH_HEALTHY_JS, timeout=120_000)
    seen.append(await page.evaluate(ROW_JS, "rollout-0"))
    await page.wait_for_function(f"() => ({ROW_JS})('rollout-0')[1].includes('dead')", timeout=240_000)
    seen.append(await page.evaluate(ROW_JS, "rollout-0"))
    await page.wait_for_function(f"() => ({ROW_JS})('rollout-0')[1].includes('relaunching')", timeout=240_000)
    seen.append(await page.evaluate(ROW_JS, "rollout-0"))
    await page.wait_for_function(
        f"() => ({BOTH_HEALTHY_JS})() && ({ROW_JS})('rollout-0')[1].endsWith('relaunching → healthy')",
        timeout=240_000)
    seen.append(await page.evaluate(ROW_JS, "rollout-0"))
    recovered.set()


def assert_timeline_accounts_for_each_step(path: Path) -> None:
    events = json.loads(path.read_text())["traceEvents"]
    for event in events:
        assert event["ph"] in ("X", "M") and isinstance(event["pid"], int) and isinstance(event["tid"], int)
        if event["ph"] == "X":
            assert event["ts"] >= 0 and event["dur"] >= 0 and "rollout_id" in event["args"]
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["name"] == "thread_name"}
    steps = [e for e in events if e["name"] == "step"]
    assert [s["args"]["rollout_id"] for s in steps] == list(range(ROLLOUTS))
    for step in steps:
        phases = [e for e in events if e["ph"] == "X" and names.get((e["pid"], e["tid"])) == "phases"
                  and step["ts"] <= e["ts"] and e["ts"] + e["dur"] <= step["ts"] + step["dur"] + 1]
        assert {"generate", "train", "weight sync"} <= {e["name"] for e in phases}
        assert sum(e["dur"] for e in phases) >= 0.95 * step["dur"], (step, phases)
    rows = set(names.values())
    assert {"rank 0", "rollout-0", "rollout-1"} <= rows  # the ranks' steps and each engine's weight sync
    assert any(e["name"] == "recovery" for e in events) and any(e["name"] == "health probe" for e in events)


async def test_page_metrics_and_status_follow_a_run_whose_engine_is_killed(tiny_model_dir: Path,
                                                                           tmp_path: Path) -> None:
    executable = chromium()
    from playwright.async_api import async_playwright

    run_dir = tmp_path / "run"
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    config = parse_config([
        "--hf-checkpoint", str(tiny_model_dir), "--engine-backend", "cpu", "--rollout-num-engines", "2",
        "--actor-num-gpus-per-node", "1", "--prompt-data", "builtin:first_digit", "--num-rollout", str(ROLLOUTS),
        "--rollout-batch-size", "4", "--n-samples-per-prompt", "2", "--rollout-max-response-len", "8",
        "--run-dir", str(run_dir), "--no-progress", "--lr", "1e-3", "--sglang-api-key", KEY,
        "--use-fault-tolerance", "--ft-components", "rollout", "--inject-engine-fault-at-rollout", "2",
        "--rollout-health-check-interval", "0.5", "--rollout-health-check-timeout", "2",
        "--status-port", str(port),
    ])
    recovered = anyio.Event()
    seen: list[list[str]] = []
    probes: list[Probe] = []
    async with async_playwright() as playwright:
        browser = await playwright.chromium.launch(executable_path=executable, args=CHROMIUM_ARGS)
        try:
            page = await browser.new_page(viewport={"width": 1000, "height": 900})

            def hooks(services: Services) -> list[Any]:
                probes.append(Probe(run_dir, url, page, recovered))
                return probes

            async with anyio.create_task_group() as group:
                group.start_soon(watch_page, page, url, recovered, seen)
                summary = await run_training(config, extra_hooks=hooks)
        finally:
            await browser.close()

    assert summary["ft"]["injected"] == ["rollout-0"]
    assert seen[0][0] == "healthy"
    assert "dead" in seen[1][1] and seen[-1][0] == "healthy"
    changes = seen[-1][1].split(" → ")
    assert changes.index("dead") < changes.index("relaunching") < len(changes) - 1
    screenshot = run_dir / "status_page.png"
    assert screenshot.stat().st_size > 10_000 and screenshot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    probe = probes[0]
    assert probe.unauthorised == 401, "/status without the run's API key"
    assert probe.metrics["rayless_rollouts_completed_total"].value == 4  # rollouts 0-3: done before its hooks
    assert probe.metrics["rayless_rollouts_planned"].value == ROLLOUTS
    assert probe.metrics["rayless_run_elapsed_seconds"].value > 0
    assert probe.metrics["rayless_engine_state"].labels["state"] == "healthy"
    assert KEY not in probe.running_text
    assert "running · 4/5 rollouts" in probe.running_text and f"from status server {url}" in probe.running_text
    assert "rollout-0" in probe.running_text and "healthy" in probe.running_text
    code, stacks, errors = probe.stacks  # the coordinator's loop tasks, its threads, the rank, both live engines
    assert code == 0, errors
    assert "event loop tasks ===" in stacks and "after_step" in stacks and "(no answer)" not in stacks
    sections = stacks.split("\n=== ")
    rank = next(section for section in sections if section.startswith("rank0 (pid"))
    assert "workers/train_rank" in rank, rank
    engines = [section for section in sections if section.startswith("engine-")]
    assert len(engines) == 2 and all("workers/engine" in section for section in engines), engines
    assert list((run_dir / "stacks").glob("dump-*.txt"))
    # One source for a rate: /metrics' per-engine tokens/s are a logged row's, and add up to its total (the
    # terminal's rollout rate), however the requests fell between the two engines.
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert probe.engine_rates and set(probe.engine_rates) <= {"rollout-0", "rollout-1"}, probe.engine_rates
    row = next(r for r in rows if all(r.get(f"rollout/tokens_per_s/{name}") == pytest.approx(rate)
                                      for name, rate in probe.engine_rates.items()))
    assert sum(probe.engine_rates.values()) == pytest.approx(row["rollout/tokens_per_s"])

    assert_timeline_accounts_for_each_step(run_dir / "timeline.json")
    code, finished = status_text([str(run_dir)])
    assert code == 0 and "finished · 5/5 rollouts" in finished and "from files in" in finished
    assert not (run_dir / "status_url").exists()
    assert KEY not in (run_dir / "status.json").read_text()
