"""The Tinker service's status: a JSON document of what it holds now, and the page that shows it.

Owns `document` (built from the server's own tables on each `GET /status`: its sessions and how long since
each was heard from, its training models with their queued requests, optimizer steps and the ranks' own
seconds for the last command of each kind, its samplers, its pending futures) and `PAGE`, the HTML served at
`/` — static, no data in it: it polls `status` with the key taken from the URL's `#key=` fragment, which no
server sees, as the run's status page does (`coordinator/status/page.html`). Invariant: the document is read
from memory only (no await, no rank asked), so a busy model never delays it; the key guards it like every call.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping

from coordinator.tinker.futures import FutureStore
from coordinator.tinker.models import TrainingModel
from coordinator.tinker.sampling import Sampler
from coordinator.tinker.sessions import Sessions
from workers.boundary.json_input import JsonObject


def document(*, base_models: Iterable[str], sessions: Sessions, models: Mapping[str, TrainingModel],
             samplers: Mapping[str, Sampler], futures: FutureStore) -> JsonObject:
    now = time.monotonic()
    session_rows: list[JsonObject] = [
        {"session_id": s.session_id, "seconds_since_heard": round(now - s.seen, 1), "models": list(s.models),
         "sampling_sessions": len(s.samplers)} for s in sessions.live.values()]
    model_rows: list[JsonObject] = [
        {"model_id": m.model_id, "session_id": m.session_id, "base_model": m.base_name,
         "lora_rank": m.lora.rank if m.lora is not None else None, "ranks": m.ranks,
         "state": "stopped" if m.stopped is not None else ("ready" if m.ready else "starting"),
         "stopped_because": m.stopped, "queued": m.queued(), "optim_steps": m.steps,
         "rank_seconds": dict(m.rank_seconds)} for m in models.values()]
    sampler_rows: list[JsonObject] = [
        {"base_model": name, "started": s.api is not None, "in_flight": s.in_flight, "weights": s.current}
        for name, s in samplers.items()]
    return {"service": "rayless tinker-server", "base_models": sorted(base_models),
            "sessions": session_rows, "models": model_rows, "samplers": sampler_rows,
            "futures_pending": futures.pending(), "sessions_ended": len(sessions.ended)}


PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>rayless tinker-server</title>
<style>body{font:14px system-ui,sans-serif;margin:1.5em}table{border-collapse:collapse;margin-bottom:1.2em}
td,th{border:1px solid #ccc;padding:2px 8px;text-align:left}#error{color:#b00}</style></head>
<body><h1>rayless tinker-server</h1><p id="error"></p><p id="summary"></p>
<h2>Models</h2><table id="models"></table><h2>Sessions</h2><table id="sessions"></table>
<h2>Samplers</h2><table id="samplers"></table>
<script>
// The page holds no data: it polls ./status with the key from #key=KEY (a fragment no server sees).
const KEY = new URLSearchParams(location.hash.slice(1)).get("key");
function cell(value) {
  const td = document.createElement("td");
  td.textContent = value === null || value === undefined ? "" :
    (typeof value === "object" ? JSON.stringify(value) : String(value));
  return td;
}
function fill(id, rows, columns) {
  const table = document.getElementById(id);
  table.replaceChildren();
  const head = document.createElement("tr");
  for (const c of columns) { const th = document.createElement("th"); th.textContent = c; head.append(th); }
  table.append(head);
  for (const row of rows) { const tr = document.createElement("tr"); for (const c of columns) tr.append(cell(row[c])); table.append(tr); }
}
async function poll() {
  try {
    const response = await fetch("status", { headers: KEY ? { "X-API-Key": KEY } : {}, cache: "no-store" });
    if (!response.ok) throw new Error(`/status answered ${response.status}${response.status === 401 ? " (open the page with #key=API_KEY)" : ""}`);
    const doc = await response.json();
    document.getElementById("error").textContent = "";
    document.getElementById("summary").textContent =
      `base models: ${doc.base_models.join(", ")} · futures pending: ${doc.futures_pending} · sessions ended: ${doc.sessions_ended}`;
    fill("models", doc.models, ["model_id", "base_model", "state", "queued", "optim_steps", "rank_seconds", "lora_rank", "ranks", "stopped_because"]);
    fill("sessions", doc.sessions, ["session_id", "seconds_since_heard", "models", "sampling_sessions"]);
    fill("samplers", doc.samplers, ["base_model", "started", "in_flight", "weights"]);
  } catch (error) { document.getElementById("error").textContent = String(error); }
}
poll(); setInterval(poll, 1000);
</script></body></html>
"""
