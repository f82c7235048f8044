"""A real HTTP reward service on 127.0.0.1 for `--rm-type remote_rm` tests (standard library server, own thread).

It answers `POST /score` with `{"prompt", "response", "label"}` by the label:
- `dict:<x>`: `{"score": 1.0 if response == x else -1.0, "acc": ...}`;
- `refuse`: HTTP 400 `{"error": "label refused by the reward service"}`;
- `flaky:<n>:<x>`: HTTP 503 for the first n requests of that label, then as `<x>`;
- `hostile:<kind>`: a bad 200 answer (`HOSTILE`: nested 100k deep, 20 MB, NaN, a list, a NaN in a dict);
- anything else: 1.0 when the response equals the label, else 0.0.
Every request's body and headers are recorded. `serve()` is a context manager that stops it on exit.
"""

from __future__ import annotations

import json
import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

#: the bad answers of a hostile reward service, as raw bytes (NaN is not JSON; json.dumps writes it anyway)
HOSTILE: dict[str, bytes] = {
    "deep": b"[" * 100_000 + b"]" * 100_000,
    "huge": b"[" + b"1.0," * (5 << 20) + b"1.0]",
    "nan": b"NaN",
    "inf": b"1e999",
    "list": b"[1.0, 2.0]",
    "nan_in_dict": b'{"score": NaN}',
}


@dataclass
class RewardService:
    url: str = ""
    bodies: list[dict[str, Any]] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    per_label: Counter[str] = field(default_factory=Counter)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def answer(self, body: dict[str, Any]) -> tuple[int, Any]:
        label = str(body.get("label"))
        with self.lock:
            self.per_label[label] += 1
            seen = self.per_label[label]
        if label.startswith("flaky:"):
            _, failures, label = label.split(":", 2)
            if seen <= int(failures):
                return 503, {"error": "warming up"}
        if label.startswith("hostile:"):
            return 200, HOSTILE[label.removeprefix("hostile:")]
        if label == "refuse":
            return 400, {"error": "label refused by the reward service"}
        if label.startswith("dict:"):
            right = body.get("response") == label.removeprefix("dict:")
            return 200, {"score": 1.0 if right else -1.0, "acc": 1.0 if right else 0.0}
        return 200, 1.0 if body.get("response") == label else 0.0


@contextmanager
def serve() -> Iterator[RewardService]:
    service = RewardService()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", "0"))))
            with service.lock:
                service.bodies.append(body)
                service.headers.append(dict(self.headers))
            status, payload = service.answer(body)
            data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, name="reward-service", daemon=True)
    thread.start()
    service.url = f"http://127.0.0.1:{server.server_address[1]}/score"
    try:
        yield service
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)
