"""The Tinker service's per-call overhead: what a `forward_backward` and an `optim_step` cost the official SDK's
caller beyond the ranks' own time for the same work.

Starts `rayless tinker-server` on the tiny model (a subprocess: its torchrun rank), creates a LoRA training
client with the SDK and times, call by call, `forward_backward(batch).result()` and `optim_step(...).result()`
from this process. The floor is measured in the same calls: each reply's `rank_seconds:max`, the rank's own
time for the command (forward, loss, backward; or the Adam step). The overhead is the difference: the SDK's two
HTTP round trips (submit, `retrieve_future`), the protobuf bodies, the per-model queue, the control channel.
Prints the medians and exits 1 when the median overhead of either call passes `--target-ms`. Usage:
python -m bench.tinker_overhead [--calls 30] [--batch 8] [--target-ms 150]
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=30)
    parser.add_argument("--batch", type=int, default=8, help="data per forward_backward")
    parser.add_argument("--target-ms", type=float, default=150.0, help="the median overhead allowed per call")
    options = parser.parse_args()

    import numpy as np
    import tinker
    from tinker import types

    from coordinator.engines.spec import free_port
    from workers.tiny_model import TinyModelSpec, build_tiny_model

    root = Path(tempfile.mkdtemp(prefix="tinker-bench-"))
    model = build_tiny_model(root / "model", TinyModelSpec(untied_head=True))
    port, key = free_port(), "tml-bench"
    log = (root / "server.log").open("wb")
    server = subprocess.Popen([sys.executable, "-m", "coordinator.cli", "tinker-server", "--port", str(port),
                               "--api-key", key, "--base-model", f"tiny={model}", "--run-dir", str(root / "run")],
                              stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "TINKER_TELEMETRY": "0"})
    try:
        deadline = time.monotonic() + 120
        while b"ready on" not in (root / "server.log").read_bytes():
            if server.poll() is not None or time.monotonic() > deadline:
                print((root / "server.log").read_text(errors="replace")[-3000:])
                return 1
            time.sleep(0.2)
        client = tinker.ServiceClient(base_url=f"http://127.0.0.1:{port}", api_key=key)
        training = client.create_lora_training_client(base_model="tiny", rank=8).result()
        tokens = list(range(3, 35))
        batch = [types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                             loss_fn_inputs={"target_tokens": np.array(tokens[1:]),
                                             "weights": np.ones(len(tokens) - 1, dtype=np.float32)})] * options.batch
        figures: dict[str, list[tuple[float, float]]] = {"forward_backward": [], "optim_step": []}
        for index in range(options.calls + 2):
            started = time.perf_counter()
            backward = training.forward_backward(batch, "cross_entropy").result()
            middle = time.perf_counter()
            step = training.optim_step(types.AdamParams(learning_rate=1e-4)).result()
            ended = time.perf_counter()
            if index < 2:
                continue  # warm-up: the first forward and the optimizer's state
            figures["forward_backward"].append((middle - started, backward.metrics["rank_seconds:max"]))
            figures["optim_step"].append((ended - middle, (step.metrics or {})["rank_seconds:max"]))
        client.close("success").result()
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=60)
        log.close()

    failed = False
    print(f"{options.calls} calls, {options.batch} data of {len(tokens) - 1} tokens, tiny model, LoRA rank 8, "
          f"1 rank, load {os.getloadavg()[0]:.1f}")
    print(f"{'call':<18}{'wall ms':>10}{'rank ms':>10}{'overhead ms':>14}{'wall/rank':>11}")
    for call, rows in figures.items():
        wall = statistics.median(w for w, _ in rows) * 1000
        rank = statistics.median(r for _, r in rows) * 1000
        overhead = statistics.median(w - r for w, r in rows) * 1000
        print(f"{call:<18}{wall:>10.1f}{rank:>10.1f}{overhead:>14.1f}{wall / max(rank, 1e-9):>11.1f}")
        failed |= overhead > options.target_ms
    print("target: median overhead per call <=", options.target_ms, "ms:", "FAIL" if failed else "ok")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
