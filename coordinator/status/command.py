"""`rayless status RUN_DIR` / `rayless status --url URL`: a run's status in the terminal.

Owns where the document comes from — the run's status server (its URL from `--url`, or from
`<run_dir>/status_url` while the run goes on), else `<run_dir>/status.json` (the last document of a run that
ended), else what the run directory's files say (config.json, metrics.jsonl, summary.json, timeline.json) —
and the text made of it. Exit status: 0 shown, 1 nothing to show (no server answers, no such run), 2 bad
arguments. Everything read (a peer's reply, a file) is read under a cap and decoded through `workers.boundary`,
its shape checked and its text stripped of control characters before it is printed (`coordinator.status.reading`).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from coordinator.observe.progress import is_evaluation_row
from coordinator.status.reading import (
    MAX_BYTES,
    NoStatus,
    check_shape,
    fetch,
    printable,
    read_capped,
    status_endpoint,
)
from workers.boundary.errors import BoundaryError
from workers.boundary.exposure import key_problem
from workers.boundary.json_input import JsonLimits, JsonObject, JsonValue, decode_json

LIMITS = JsonLimits(max_bytes=MAX_BYTES)
MAX_URL_FILE_BYTES = 4096


def from_server(url: str, api_key: str | None) -> JsonObject:
    endpoint = status_endpoint(url)
    return check_shape(decode_json(fetch(url, api_key), endpoint, LIMITS), endpoint)


def _json_file(path: Path) -> JsonValue:
    return decode_json(read_capped(path), str(path), LIMITS)


def from_files(run_dir: Path) -> JsonObject:
    """The last document (`status.json`), else one pieced together from the run's files."""
    final = run_dir / "status.json"
    if final.is_file():
        return _json_file(final)
    if not (run_dir / "config.json").is_file():
        raise NoStatus(f"{run_dir} is not a run directory (no config.json, no status.json)")
    rows = []
    metrics = run_dir / "metrics.jsonl"
    if metrics.is_file():
        for number, line in enumerate(read_capped(metrics, tail=True).splitlines(), 1):
            if line.strip():
                row = decode_json(line, f"{metrics}:{number}", LIMITS)
                if isinstance(row, dict):
                    rows.append(row)
    summary = _json_file(run_dir / "summary.json") if (run_dir / "summary.json").is_file() else {}
    config = _json_file(run_dir / "config.json")
    planned = _planned_rollouts(config)
    last = rows[-1] if rows else {}
    return {
        "run": {"run_dir": str(run_dir), "config_digest": "",
                "state": summary.get("outcome", "finished") if summary
                else "not finished (no status server: running, or killed)",
                "rollouts_done": summary.get("rollouts", (last.get("step", -1) + 1) if rows else 0),
                "num_rollout": planned, "elapsed_s": summary.get("wall_s"), "eta_s": None,
                "weight_version": summary.get("final_weight_version", last.get("weight_version")), "phase": ""},
        "engines": [], "ranks": [], "eval": None, "events": [], "metrics": rows[-500:], "timeline": [],
    }


def _planned_rollouts(config: Any) -> int | None:
    value = config.get("num_rollout") if isinstance(config, dict) else None
    return value if isinstance(value, int) else None


def load(run_dir: Path | None, url: str | None, api_key: str | None) -> tuple[JsonObject, str]:
    """(document, where it came from)."""
    if url is not None:
        return from_server(url, api_key), f"status server {url}"
    assert run_dir is not None
    if not run_dir.is_dir():
        raise NoStatus(f"{run_dir}: no such run directory")
    url_file = run_dir / "status_url"
    tried = ""
    if url_file.is_file():
        with open(url_file, "rb") as file:
            recorded = file.read(MAX_URL_FILE_BYTES).decode("utf-8", errors="replace").strip()
        try:
            return from_server(recorded, api_key), f"status server {recorded}"
        except NoStatus as error:
            tried = f" ({error}; the run may have been killed)"
    return check_shape(from_files(run_dir), str(run_dir)), f"files in {run_dir}{tried}"


def _clock(seconds: JsonValue) -> str:
    if not isinstance(seconds, int | float):
        return "?"
    s = max(0, int(seconds))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


def _num(value: JsonValue, fmt: str) -> str:
    return format(value, fmt) if isinstance(value, int | float) else "-"


def _table(header: Sequence[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *rows, strict=False)]
    return ["  " + "  ".join(str(cell).ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
            for row in [list(header), *rows]]


#: a run's states once it is over (`StatusService.finish`'s outcomes)
_ENDED = frozenset({"finished", "interrupted", "failed"})


def render(document: JsonObject, source: str) -> str:
    run = document["run"]
    # an ETA only while the run goes on: an ended run's is not unknown, there is none
    eta = "" if run["state"] in _ENDED else f" · ETA {_clock(run.get('eta_s'))}"
    # a count of rollouts done, not a rollout id (ids count from 0: "last rollouts" below)
    lines = [f"run {run['run_dir']}: {run['state']} · {run['rollouts_done']}/{run['num_rollout'] or '?'} rollouts · "
             f"elapsed {_clock(run.get('elapsed_s'))}{eta} · weights "
             f"{run.get('weight_version') or '-'}" + (f" · phase {run['phase']}" if run.get("phase") else ""),
             f"(from {source})"]
    if document.get("engines"):
        lines.append("engines:")
        lines += _table(("ENGINE", "STATE", "ADDRESS", "IN FLIGHT", "WEIGHTS", "TOKENS/S", "LAST LOG LINE"), [
            [e["name"], e["state"], e["address"] or "-", str(e["in_flight"]), e.get("weight_version") or "-",
             _num(e.get("tokens_per_s"), ".1f"), (e.get("dead_reason") or e.get("log_line") or "")[:70]]
            for e in document["engines"]])
    if document.get("ranks"):
        lines.append("ranks:")
        lines += _table(("RANK", "NODE", "STATE", "LAST STEP", "MEMORY"), [
            [str(r["rank"]), str(r["node"] if r["node"] is not None else "-"), r["state"],
             _num(r.get("last_step_s"), ".2f") + " s", _num((r.get("memory_bytes") or 0) / 2**20, ".0f") + " MiB"
             if r.get("memory_bytes") else "-"] for r in document["ranks"]])
    metrics = document.get("metrics") or []
    # an evaluation writes its own row beside its rollout's (read back from metrics.jsonl): a table of its own
    rows = [row for row in metrics if isinstance(row, dict) and not is_evaluation_row(row)]
    evals = [row for row in metrics if isinstance(row, dict) and is_evaluation_row(row)]
    if rows:
        lines.append("last rollouts:")
        lines += _table(("ROLLOUT", "REWARD", "RESPONSE LEN", "GENERATE", "TRAIN", "SYNC"), [
            [str(row.get("step")), _num(row.get("rollout/reward_mean"), ".3f"),
             _num(row.get("rollout/response_len_mean"), ".1f"), _num(row.get("rollout/time_s"), ".2f") + " s",
             _num(row.get("train/time_s"), ".2f") + " s", _num(row.get("sync/time_s"), ".2f") + " s"]
            for row in rows[-5:]])
    fleet = document.get("eval") or {}
    if isinstance(fleet.get("records"), list) and fleet["records"]:  # the eval fleet's, done or skipped
        evals = [{**(record.get("metrics") or {}), "step": record.get("pinned_step"),
                  "eval/weight_version": record.get("weight_version"),
                  "status": record.get("status") if record.get("status") != "done" else None,
                  "reason": record.get("reason")} for record in fleet["records"] if isinstance(record, dict)]
    if evals:
        lines.append("last evaluations:")
        lines += _table(("ROLLOUT", "WEIGHTS", "REWARD PER DATASET"), [
            [str(row.get("step")), str(row.get("eval/weight_version") or "-"), _eval_rewards(row)]
            for row in evals[-5:]])
    if document.get("events"):
        lines.append("failures and recoveries:")
        lines += [f"  {e['engine']}: {e['kind']} {e.get('detail', '')[:90]}" for e in document["events"][-10:]]
    return "\n".join(lines)


def _eval_rewards(row: dict[str, Any]) -> str:
    """An evaluation's mean reward per dataset (`eval/<name>/reward_mean`), or why it did not run."""
    if row.get("status") or "eval/skipped" in row:
        return f"skipped: {row.get('reason') or row.get('eval/skip_reason') or row.get('status')}"
    return "  ".join(f"{key[len('eval/'):-len('/reward_mean')]} {_num(value, '.3f')}"
                     for key, value in sorted(row.items()) if key.endswith("/reward_mean"))


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="rayless status", description="Show a run's status: from its status "
                                     "server while it runs (--status-port), else from its run directory.")
    parser.add_argument("run_dir", nargs="?", type=Path, help="the run's --run-dir")
    parser.add_argument("--url", help="the status server's address (http://HOST:PORT), instead of RUN_DIR")
    parser.add_argument("--api-key", help="the run's --sglang-api-key, when it has one")
    parser.add_argument("--json", action="store_true", help="print the status document as JSON")
    options = parser.parse_args(list(argv))
    if (options.run_dir is None) == (options.url is None):
        parser.error("give RUN_DIR or --url (one of them)")
    if options.api_key is not None and (problem := key_problem(options.api_key)):
        parser.error(f"--api-key {problem}")
    try:
        document, source = load(options.run_dir, options.url, options.api_key)
    except (NoStatus, BoundaryError, OSError) as error:
        print(f"rayless status: {printable(str(error))}", file=sys.stderr)
        return 1
    document, source = printable(document), printable(source)
    print(json.dumps(document, indent=2) if options.json else render(document, source))
    return 0
