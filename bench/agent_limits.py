"""How fast the agent-facing servers refuse what issue 40 named: a 30 MB chat message, a 2 GB declared body
(headers only, nothing allocated), a 2 MB message (under the engine's body limit, over its per-message one),
a request's own chat template of 1e10 iterations (the engine with `--trust-request-chat-template`, /health
probed meanwhile), and a control route through the session server.

Servers: the engine (`python -m workers.engine`, tiny CPU model, its own process, default limits but
`--trust-request-chat-template`), the hook endpoint and the session server in this process over that engine,
as the coordinator runs them. Floor: the engine's `/health`, in the same run. Target: every refusal under 1 s (the template: cut at its 2 s deadline, /health's
worst probe under 1 s meanwhile); the bench exits 1 otherwise.

    .venv/bin/python -m bench.agent_limits
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio
import httpx
from transformers import AutoTokenizer

from coordinator.engines.client import EngineClient
from coordinator.hooks.runtime import HookRuntime
from coordinator.rollout.dispatch import Dispatcher
from coordinator.rollout.hook_endpoint import HookEndpoint
from coordinator.sessions.server import SessionServer
from coordinator.sessions.tito import resolve_matcher, tito_tokenizer
from tests.support.engine_proc import start_engine_process
from tests.support.sockets import first_reply
from workers.tiny_model import build_tiny_model

TARGET_S = 1.0
BOMB = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"


def declared(path: str) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            "Content-Length: 2147483648\r\n\r\n").encode()


async def timed_post(url: str, body: dict[str, Any]) -> tuple[int, float]:
    """The status and the time from the first byte sent to the answer (the body encoded before)."""
    content = json.dumps(body).encode()
    async with httpx.AsyncClient(timeout=60) as http:
        started = time.perf_counter()
        answer = await http.post(url, content=content, headers={"Content-Type": "application/json"})
        return answer.status_code, time.perf_counter() - started


def timed_first_reply(host: str, port: int, data: bytes) -> tuple[int, float]:
    """Send the head; the status of the answer and the time to its first bytes (the body never sent)."""
    started = time.perf_counter()
    head = first_reply(host, port, data)
    return int(head.split(b" ", 2)[1]), time.perf_counter() - started


async def timed_raw(url: str, path: str) -> tuple[int, float]:
    host, port = url.removeprefix("http://").split(":")
    return await anyio.to_thread.run_sync(lambda: timed_first_reply(host, int(port), declared(path)))


def chat(content: str, **extra: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": content}], "max_tokens": 1, **extra}


async def template_bomb(engine_url: str) -> tuple[int, float, float]:
    """The bomb's answer, its time and the worst /health probe while it ran."""
    worst, done = 0.0, anyio.Event()

    async def probe() -> None:
        nonlocal worst
        async with httpx.AsyncClient(timeout=30) as http:
            while not done.is_set():
                started = time.perf_counter()
                assert (await http.get(f"{engine_url}/health")).status_code == 200
                worst = max(worst, time.perf_counter() - started)
                await anyio.sleep(0.02)

    async with anyio.create_task_group() as tg:
        tg.start_soon(probe)
        status, took = await timed_post(f"{engine_url}/v1/chat/completions",
                                        chat("1", chat_template_kwargs={"chat_template": BOMB}))
        done.set()
    return status, took, worst


async def main() -> int:
    rows: list[tuple[str, int, float, bool]] = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model(Path(tmp) / "tiny")
        await measure(model_dir, rows)
    for name, status, took, ok in rows:
        print(f"{name:<50} {status}  {took * 1e3:9.1f} ms  {'ok' if ok else 'FAILED'}")
    return 0 if all(ok for *_, ok in rows) else 1


async def measure(model_dir: Path, rows: list[tuple[str, int, float, bool]]) -> None:
    with start_engine_process(model_dir, extra_args=["--trust-request-chat-template"]) as running:
        engine_url = running.url
        async with httpx.AsyncClient(timeout=30) as http:  # the floor: one small request answered at once
            started = time.perf_counter()
            floor = (await http.get(f"{engine_url}/health")).status_code
            rows.append(("floor: engine /health", floor, time.perf_counter() - started, floor == 200))
        status, took = await timed_post(f"{engine_url}/v1/chat/completions", chat("x" * (30 << 20)))
        rows.append(("engine: 30 MB message", status, took, status == 413 and took < TARGET_S))
        status, took = await timed_post(f"{engine_url}/v1/chat/completions", chat("x" * (9 << 20)))
        rows.append(("engine: 9 MB message (per-message limit 8 MiB)", status, took,
                     status == 413 and took < TARGET_S))
        status, took = await timed_raw(engine_url, "/v1/chat/completions")
        rows.append(("engine: 2 GB declared body", status, took, status == 413 and took < TARGET_S))
        status, took, worst = await template_bomb(engine_url)
        rows.append(("engine: 1e10-iteration request template", status, took, status == 400 and took < 3.0))
        rows.append(("engine: worst /health during it", 200, worst, worst < TARGET_S))
        async with EngineClient(max_connections=4) as client, anyio.create_task_group() as tg:
            dispatcher = Dispatcher(client=client, pool=None, router_url=engine_url)
            hook = HookEndpoint(dispatcher=dispatcher, routes=HookRuntime(args=argparse.Namespace()).routes, seed=0)
            await tg.start(hook.run)
            sessions = SessionServer(dispatcher=dispatcher, matcher=resolve_matcher("strict"),
                                     tito=tito_tokenizer("default", AutoTokenizer.from_pretrained(str(model_dir))))
            await tg.start(sessions.run)
            session = (await sessions.create()).id
            status, took = await timed_post(f"{sessions.url}/sessions/{session}/v1/chat/completions",
                                            chat("x" * (30 << 20)))
            rows.append(("session server: 30 MB message", status, took, status == 413 and took < TARGET_S))
            status, took = await timed_raw(sessions.url, f"/sessions/{session}/v1/chat/completions")
            rows.append(("session server: 2 GB declared body", status, took, status == 413 and took < TARGET_S))
            status, took = await timed_post(f"{sessions.url}/sessions/{session}/pause_generation", {})
            rows.append(("session server: /pause_generation", status, took, status == 403 and took < TARGET_S))
            status, took = await timed_raw(hook.url, "/generate")
            rows.append(("hook endpoint: 2 GB declared body", status, took, status == 413 and took < TARGET_S))
            tg.cancel_scope.cancel()


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    sys.exit(anyio.run(main))
