"""Command-line flags of the CPU engine, named as `python -m sglang.launch_server`'s.

Owns the frozen `EngineArgs` the rest of the engine reads. Flags a GPU SGLang server takes that make no sense on
CPU (`--mem-fraction-static`, `--enable-memory-saver`, ...) are accepted and ignored so one launch line works for
both; `--tp-size` other than 1 is refused with a clear error.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass


@dataclass(frozen=True)
class EngineArgs:
    model_path: str
    tokenizer_path: str
    host: str
    port: int
    api_key: str | None
    random_seed: int | None
    weight_version: str
    skip_server_warmup: bool
    max_running_requests: int
    context_length: int | None
    enable_metrics: bool
    log_level: str
    dtype: str


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rayless engine", description="SGLang-compatible HTTP server for a Hugging Face causal LM on CPU"
    )
    parser.add_argument("--model-path", required=True, help="local Hugging Face model directory")
    parser.add_argument("--tokenizer-path", default=None, help="defaults to --model-path")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument(
        "--api-key", default=None, help="require 'Authorization: Bearer KEY' (except /health*, /metrics)"
    )
    parser.add_argument("--random-seed", type=int, default=None)
    parser.add_argument("--weight-version", default="default")
    parser.add_argument("--skip-server-warmup", action="store_true")
    parser.add_argument("--max-running-requests", type=int, default=256)
    parser.add_argument(
        "--context-length", type=int, default=None, help="defaults to the model's max positions"
    )
    parser.add_argument("--enable-metrics", action="store_true", help="accepted; /metrics is always served")
    parser.add_argument(
        "--log-level", default="info", choices=["debug", "info", "warning", "error", "critical"]
    )
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="float32 by default on CPU so rollout logprobs match a float32 trainer",
    )
    parser.add_argument("--tp-size", "--tensor-parallel-size", type=int, default=1)
    # Accepted for launch-line compatibility with GPU SGLang; they have no meaning on the CPU engine.
    for flag in ("--mem-fraction-static", "--chunked-prefill-size", "--dp-size", "--base-gpu-id"):
        parser.add_argument(flag, default=None, help=argparse.SUPPRESS)
    for flag in (
        "--enable-memory-saver",
        "--trust-remote-code",
        "--disable-radix-cache",
        "--disable-cuda-graph",
    ):
        parser.add_argument(flag, action="store_true", help=argparse.SUPPRESS)
    return parser


def parse_args(argv: list[str] | None) -> EngineArgs:
    parser = build_parser()
    ns = parser.parse_args(argv)
    if ns.tp_size != 1:
        parser.error(f"--tp-size {ns.tp_size}: the CPU engine runs one process; use --tp-size 1")
    if ns.max_running_requests < 1:
        parser.error("--max-running-requests must be >= 1")
    if ns.context_length is not None and ns.context_length < 2:
        parser.error("--context-length must be >= 2")
    if not 0 <= ns.port < 65536:
        parser.error(f"--port {ns.port} is not a TCP port")
    return EngineArgs(
        model_path=ns.model_path,
        tokenizer_path=ns.tokenizer_path or ns.model_path,
        host=ns.host,
        port=ns.port,
        api_key=ns.api_key,
        random_seed=ns.random_seed,
        weight_version=ns.weight_version,
        skip_server_warmup=ns.skip_server_warmup,
        max_running_requests=ns.max_running_requests,
        context_length=ns.context_length,
        enable_metrics=ns.enable_metrics,
        log_level=ns.log_level,
        dtype=ns.dtype,
    )
