"""Start a real CPU engine (`python -m workers.engine`) for tests and benchmarks, and always stop it.

Owns the engine subprocesses that tests start. Invariant: the process is started in its own session and its
whole process group is terminated (then killed) when the context exits, on every path, so no test leaves an
orphan. A process that dies while starting is reported with the tail of its log instead of a timeout.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from coordinator.lifecycle.processes import exit_status, read_tail, terminate_process_group_blocking
from tests.support.waiting import wait_until_sync
from workers.tiny_model import TinyModelSpec

# A ~22 M-parameter model (84 MiB in float32): big enough that freeing its weights shows in RSS / GPU memory.
MID_MODEL_SPEC = TinyModelSpec(
    hidden_size=512, num_hidden_layers=7, intermediate_size=1536, num_attention_heads=8, num_key_value_heads=4
)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass(frozen=True)
class RunningEngine:
    url: str
    process: subprocess.Popen[bytes]
    log_path: Path

    def log_tail(self, lines: int = 40) -> str:
        return read_tail(self.log_path, lines) or "<no log>"


@contextmanager
def start_engine_process(
    model_dir: str | Path,
    *,
    api_key: str | None = None,
    extra_args: Sequence[str] = (),
    threads: int = 1,
    startup_timeout_s: float = 90.0,
    log_path: str | Path | None = None,
    module: str = "workers.engine",
) -> Iterator[RunningEngine]:
    """Launch an engine on a free 127.0.0.1 port; yield once /health answers 200. `module`: another server
    that takes the engine's flags (e.g. `tests.support.sglang_receiver`)."""
    port = free_port()
    own_log = log_path is None  # a log made here is removed when the engine stops: tests leave no files in /tmp
    if log_path is None:
        handle, name = tempfile.mkstemp(prefix="rayless-engine-", suffix=".log")
        os.close(handle)
        log_path = Path(name)
    log_path = Path(log_path)
    command = [sys.executable, "-m", module, "--model-path", str(model_dir), "--port", str(port)]
    command += ["--random-seed", "0", "--log-level", "warning"]
    if api_key:
        command += ["--api-key", api_key]
    command += list(extra_args)
    env = {**os.environ, "RAYLESS_ENGINE_THREADS": str(threads)}
    with open(log_path, "wb") as log_file:
        process = subprocess.Popen(
            command, stdout=log_file, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    engine = RunningEngine(url=f"http://127.0.0.1:{port}", process=process, log_path=log_path)
    try:
        _wait_healthy(engine, startup_timeout_s)
        yield engine
    finally:
        terminate_process_group_blocking(process, grace=10.0)
        if own_log:
            log_path.unlink(missing_ok=True)


def _wait_healthy(engine: RunningEngine, timeout_s: float) -> None:
    with httpx.Client(timeout=2.0) as client:

        def healthy() -> bool:
            code = exit_status(engine.process)
            if code is not None:
                raise RuntimeError(
                    f"engine exited with code {code} while starting; log tail:\n{engine.log_tail()}"
                )
            return client.get(engine.url + "/health").status_code == 200

        try:  # (the port opens only after the weights load: refused connections are retried)
            wait_until_sync(healthy, timeout=timeout_s, interval=0.1, ignoring=(httpx.TransportError,),
                            what="the engine's /health to answer 200")
        except AssertionError as error:
            raise TimeoutError(f"engine not healthy: {error}; log tail:\n{engine.log_tail()}") from None


@contextmanager
def start_engine(
    model_dir: str | Path, *, api_key: str | None = None, extra_args: Sequence[str] = ()
) -> Iterator[str]:
    """The common case: yield the engine's base URL (http://127.0.0.1:PORT)."""
    with start_engine_process(model_dir, api_key=api_key, extra_args=extra_args) as engine:
        yield engine.url
