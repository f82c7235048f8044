"""`rayless tinker-server`: its flags, checked before any port opens or process starts, and its lifetime.

Owns `main`. Exit statuses as every rayless command: 0 after a stop signal, 2 for a bad flag (a base model
that is not a model directory, a key the SDK would refuse, a host beyond loopback without a key). Prints
`tinker-server ready on URL` once it listens (scripts and tests wait for that line).
"""

from __future__ import annotations

import argparse
import logging
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from coordinator.tinker.server import BaseModel, Limits

USAGE_NOTE = """The official SDK talks to it unchanged but for its address:
  TINKER_API_KEY=tml-KEY python -c 'import tinker; tinker.ServiceClient(base_url="http://127.0.0.1:PORT")'
Training runs on torchrun ranks (LoRA with peft, or full fine-tuning), sampling on an engine per base model."""


def parser() -> argparse.ArgumentParser:
    from coordinator.tinker.server import Limits

    limits = Limits()
    p = argparse.ArgumentParser(prog="rayless tinker-server", epilog=USAGE_NOTE,
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                description="Serve the Tinker training API on this machine's ranks and engines.")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None,
                   help="the key every call must carry (the SDK's TINKER_API_KEY; it starts with tml-)")
    p.add_argument("--allow-unauthenticated", action="store_true",
                   help="listen beyond loopback without --api-key")
    p.add_argument("--base-model", action="append", default=[], metavar="NAME=PATH", required=True,
                   help="a base model clients may train and sample: its name and local Hugging Face directory "
                   "(PATH alone: the directory's path is its name); repeatable")
    p.add_argument("--sampler-url", action="append", default=[], metavar="NAME=URL",
                   help="sample base model NAME on the SGLang-compatible engine running at URL (SGLang's "
                   "launch_server or the in-repo engine, started on that base model) instead of launching one; "
                   "it must read this service's --run-dir (sampler checkpoints load from disk); repeatable")
    p.add_argument("--sampler-api-key", default=None,
                   help="the attached engines' --api-key (sent as Authorization: Bearer)")
    p.add_argument("--run-dir", default="tinker-run", help="checkpoints, logs and the ranks' files")
    p.add_argument("--train-ranks", type=int, default=1, help="torchrun ranks per training model")
    p.add_argument("--data-parallel", choices=("auto", "fsdp", "replicate"), default="auto",
                   help="the ranks' data parallelism: FSDP2 on CUDA and replicas on the CPU (auto), or forced")
    p.add_argument("--session-timeout", type=float, default=60.0,
                   help="seconds without a heartbeat after which a session's models are stopped (the SDK beats "
                   "every 10 s)")
    p.add_argument("--max-models", type=int, default=limits.max_models)
    p.add_argument("--max-batch-datums", type=int, default=limits.max_batch_datums,
                   help="data per forward_backward request (the SDK chunks at this)")
    p.add_argument("--max-tokens", type=int, default=limits.max_tokens, help="tokens per datum or prompt")
    p.add_argument("--max-batch-tokens", type=int, default=limits.max_batch_tokens)
    p.add_argument("--max-samples", type=int, default=limits.max_samples, help="num_samples per asample")
    p.add_argument("--max-body-bytes", type=int, default=limits.max_body_bytes)
    return p


def main(argv: Sequence[str]) -> int:
    options = parser().parse_args(list(argv))
    from coordinator.tinker.server import BaseModel, Limits
    from workers.boundary.exposure import exposure_problem, key_problem

    problems = []
    bases = []
    for spec in options.base_model:
        name, _, path = spec.rpartition("=") if "=" in spec else (spec, "=", spec)
        try:
            bases.append(BaseModel.read(name or path, path))
        except ValueError as error:
            problems.append(str(error))
    names = {(spec.rpartition("=")[0] or spec) if "=" in spec else spec for spec in options.base_model}
    attached: dict[str, str] = {}
    for spec in options.sampler_url:
        name, _, url = spec.partition("=")
        if name not in names:
            problems.append(f"--sampler-url {spec[:200]!r}: NAME must be one of the --base-model names "
                            f"({', '.join(sorted(names)) or 'none given'})")
        elif not re.fullmatch(r"https?://[^\s/]+(:[0-9]+)?/?", url):
            problems.append(f"--sampler-url {spec[:200]!r}: URL must be http(s)://HOST:PORT")
        else:
            attached[name] = url.rstrip("/")
    options.attached = attached
    if options.sampler_api_key is not None and (bad := key_problem(options.sampler_api_key)) is not None:
        problems.append(f"--sampler-api-key {bad}")
    if options.api_key is not None:
        bad = key_problem(options.api_key)
        if bad is None and not options.api_key.startswith("tml-"):
            bad = "does not start with tml- (the tinker SDK refuses any other key)"
        if bad is not None:
            problems.append(f"--api-key {bad}")
    exposed = exposure_problem(options.host, has_key=options.api_key is not None,
                               allowed=options.allow_unauthenticated, host_flag="--host", key_flag="--api-key")
    if exposed:
        problems.append(exposed)
    numbers = ("train_ranks", "max_models", "max_batch_datums", "max_tokens", "max_batch_tokens", "max_samples",
               "max_body_bytes")
    problems += [f"--{name.replace('_', '-')} must be >= 1" for name in numbers if getattr(options, name) < 1]
    if options.session_timeout < 15:
        problems.append("--session-timeout must be >= 15 s (the SDK heartbeats every 10 s)")
    if problems:
        for problem in problems:
            print(f"rayless tinker-server: {problem}", file=sys.stderr)
        return 2
    limits = Limits(max_models=options.max_models, max_batch_datums=options.max_batch_datums,
                    max_tokens=options.max_tokens, max_batch_tokens=options.max_batch_tokens,
                    max_samples=options.max_samples, max_body_bytes=options.max_body_bytes)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per engine call would bury the service's own
    return _serve(options, bases, limits)


def _serve(options: argparse.Namespace, bases: list[BaseModel], limits: Limits) -> int:
    import anyio

    from coordinator.lifecycle.signals import StopSignals, run_until_signalled
    from coordinator.tinker.server import TinkerServer

    run_dir = Path(options.run_dir).resolve()  # engines attached by --sampler-url read its files by this path

    async def serve() -> None:
        server = TinkerServer(base_models=bases, run_dir=run_dir, api_key=options.api_key,
                              host=options.host, port=options.port, ranks=options.train_ranks, limits=limits,
                              session_timeout_s=options.session_timeout, data_parallel=options.data_parallel,
                              sampler_urls=options.attached, sampler_api_key=options.sampler_api_key)
        async with anyio.create_task_group() as group:
            await group.start(server.run)
            print(f"tinker-server ready on {server.url}", flush=True)

    stop = StopSignals()
    try:
        anyio.run(run_until_signalled, serve, stop)
    except KeyboardInterrupt:
        pass
    return 0
