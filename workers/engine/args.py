"""Command-line flags of the engine, named as `python -m sglang.launch_server`'s.

Owns the frozen `EngineArgs` the rest of the engine reads. Flags a GPU SGLang server takes that change nothing
here (`--mem-fraction-static`, `--enable-memory-saver`, ...) are accepted and ignored so one launch line works
for both; `--tp-size` other than 1 is refused with a clear error. Every check here runs before the model loads,
and a bad value exits 2 naming the flag (argparse's `error`).

Device: `--device cpu|cuda|auto` (SGLang's flag; cpu by default, as before the flag existed, so an engine
launched without it never lands on a GPU someone else planned for; `auto` is cuda when torch sees a GPU, else
cpu) and `--base-gpu-id N` (SGLang's: the engine runs on `cuda:N` of the GPUs that CUDA_VISIBLE_DEVICES shows).
`--dtype` defaults to float32 on every device, so rollout logprobs match a float32 trainer unless asked
otherwise.

Secrets and exposure: `--config FILE.yaml` is SGLang's (a YAML mapping of flag names to values, merged before the
command line, which wins), and is how the coordinator hands a launched engine its key: a 0600 file, so the key is
never on a command line (`ps` shows it to every user). `--api-key` stays for engines started by hand. A key must
be printable ASCII (an HTTP header carries it); a `--host` beyond loopback needs a key or
`--allow-unauthenticated` (ours): exit 2 naming the flags otherwise.

Request bounds (ours; SGLang has none): `--max-n` bounds `sampling_params.n`, `--max-seqs-per-request` bounds
prompts × n of one request, `--max-request-bytes` the body of any request (a larger one is a 413). They keep
one careless request from growing the engine without limit.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields
from pathlib import Path

from workers.boundary.errors import BoundaryError
from workers.boundary.exposure import exposure_problem, key_problem
from workers.boundary.json_input import JsonValue
from workers.boundary.yaml_input import load_yaml

#: A config file is a few flags; anything larger is not one.
MAX_CONFIG_BYTES = 1 << 20

# SGLang's --dtype spellings, mapped to ours.
_DTYPES = {
    "auto": "auto",
    "float32": "float32",
    "float": "float32",
    "bfloat16": "bfloat16",
    "float16": "float16",
    "half": "float16",
}


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
    device: str = "cpu"  # resolved: "cpu" or "cuda:N"
    max_n: int = 128
    max_seqs_per_request: int = 4096
    max_request_bytes: int = 64 << 20
    weight_spill_dir: str | None = None
    # SGLang's --enable-deterministic-inference (implied by --rl-on-policy-target), under its server-info name.
    enable_deterministic_inference: bool = False
    # SGLang's --rl-on-policy-target fsdp: output logprobs rescored by the trainer's function (`rescoring`).
    rl_on_policy_target: str | None = None
    log_probs_chunk_size: int | None = None  # the trainer's --log-probs-chunk-size, for that rescoring
    attn_implementation: str | None = None  # the trainer's --attn-implementation (transformers' name)
    # SGLang's --admin-api-key: the control routes' own key (`workers.boundary.engine_routes`)
    admin_api_key: str | None = None
    # vLLM's --trust-request-chat-template: a request may bring its own chat template (bounded rendering)
    trust_request_chat_template: bool = False
    max_message_bytes: int = 8 << 20


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rayless engine", description="SGLang-compatible HTTP server for a Hugging Face causal LM"
    )
    parser.add_argument("--model-path", required=True, help="local Hugging Face model directory")
    parser.add_argument("--tokenizer-path", default=None, help="defaults to --model-path")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument(
        "--api-key", default=None, help="require 'Authorization: Bearer KEY' (except /health*, /metrics); "
        "visible to every local user in ps: prefer 'api-key: KEY' in a 0600 --config file"
    )
    parser.add_argument(
        "--config", default=None, metavar="FILE.yaml",
        help="SGLang's config file: a YAML mapping of flag names (without --) to values, read before the command "
        "line (which wins)",
    )
    parser.add_argument(
        "--allow-unauthenticated", action="store_true",
        help="serve on a --host beyond loopback without --api-key (refused otherwise)",
    )
    parser.add_argument(
        "--admin-api-key", default=None, help="SGLang's: the key of the control routes (pause, weight updates, "
        "memory, flush, abort, /server_info); when set, --api-key no longer opens them"
    )
    parser.add_argument(
        "--trust-request-chat-template", action="store_true",
        help="let a request bring its own chat template ('chat_template', or chat_template_kwargs.chat_template); "
        "refused (400) by default: the template is the model's",
    )
    parser.add_argument(
        "--max-message-bytes", type=int, default=8 << 20,
        help="largest content of one chat message, in UTF-8 bytes (larger: 413)",
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
        choices=sorted(_DTYPES),
        help="float32 by default (on GPU too) so rollout logprobs match a float32 trainer; "
        "auto = the model's own dtype",
    )
    parser.add_argument(
        "--device",
        default="cpu",
        choices=["auto", "cpu", "cuda"],
        help="cpu (default), cuda, or auto: cuda when torch sees a GPU, else cpu",
    )
    parser.add_argument(
        "--base-gpu-id", type=int, default=0, help="the GPU index (among CUDA_VISIBLE_DEVICES) to run on"
    )
    parser.add_argument("--max-n", type=int, default=128, help="largest sampling_params.n accepted")
    parser.add_argument(
        "--max-seqs-per-request",
        type=int,
        default=4096,
        help="largest number of sequences (prompts x n) one /generate request may create",
    )
    parser.add_argument(
        "--max-request-bytes",
        type=int,
        default=64 << 20,
        help="largest request body accepted on any endpoint (larger: 413)",
    )
    parser.add_argument(
        "--weight-spill-dir",
        default=None,
        help="where weights released on CPU are kept until resumed (default: the system temp dir)",
    )
    parser.add_argument("--tp-size", "--tensor-parallel-size", type=int, default=1)
    _add_determinism_flags(parser)
    # Accepted for launch-line compatibility with GPU SGLang; they change nothing in this engine.
    for flag in ("--mem-fraction-static", "--chunked-prefill-size", "--dp-size"):
        parser.add_argument(flag, default=None, help=argparse.SUPPRESS)
    for flag in (
        "--enable-memory-saver",  # release/resume always works here
        "--enable-weights-cpu-backup",  # released GPU weights always get a host copy here
        "--trust-remote-code",
        "--disable-radix-cache",
        "--disable-cuda-graph",
    ):
        parser.add_argument(flag, action="store_true", help=argparse.SUPPRESS)
    return parser


def _add_determinism_flags(parser: argparse.ArgumentParser) -> None:
    """SGLang's flags of deterministic inference and true on-policy rescoring, and the trainer's settings the
    rescoring must share (docs/deterministic.md)."""
    parser.add_argument(
        "--enable-deterministic-inference",
        action="store_true",
        help="SGLang's flag: every sequence is decoded alone, so its tokens and logprobs never depend on the batch",
    )
    parser.add_argument(
        "--rl-on-policy-target",
        default=None,
        choices=["fsdp"],
        help="SGLang's flag: the logprobs of the sampled tokens are rescored, once a sequence ends, by the rayless "
        "trainer's own scoring function (implies --enable-deterministic-inference)",
    )
    parser.add_argument(
        "--attn-implementation",
        default=None,
        help="transformers' attn_implementation of the model (default sdpa); the trainer's, for equal logprobs",
    )
    parser.add_argument(
        "--log-probs-chunk-size",
        type=int,
        default=None,
        help="with --rl-on-policy-target: the trainer's --log-probs-chunk-size, so both score in the same chunks",
    )


def resolve_device(parser: argparse.ArgumentParser, device: str, base_gpu_id: int) -> str:
    """'cpu' or 'cuda:N'; exits 2 when CUDA is asked for and absent or N is not a visible GPU."""
    if base_gpu_id < 0:
        parser.error(f"--base-gpu-id must be >= 0, got {base_gpu_id}")
    if device == "cpu":
        return "cpu"
    import torch

    available = torch.cuda.is_available()
    if device == "auto" and not available:
        return "cpu"
    if not available:
        parser.error("--device cuda: torch sees no CUDA device (a CPU build of torch, or no GPU visible)")
    count = torch.cuda.device_count()
    if base_gpu_id >= count:
        parser.error(
            f"--base-gpu-id {base_gpu_id}: only {count} GPU(s) visible (CUDA_VISIBLE_DEVICES decides which)"
        )
    return f"cuda:{base_gpu_id}"


def config_file_args(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """`argv` with SGLang's `--config FILE` replaced by the file's flags, put first so the command line wins
    (SGLang's `ConfigArgumentMerger`: a key is a flag name, `true` sets a switch, a list gives several values)."""
    positions = [i for i, token in enumerate(argv) if token == "--config" or token.startswith("--config=")]
    if not positions:
        return argv
    if len(positions) > 1:
        parser.error("--config is given more than once; give one file")
    at = positions[0]
    if argv[at] == "--config":
        if at + 1 >= len(argv):
            parser.error("--config needs a file")
        path, rest = argv[at + 1], argv[:at] + argv[at + 2:]
    else:
        path, rest = argv[at].partition("=")[2], argv[:at] + argv[at + 1:]
    if Path(path).suffix.lower() not in (".yaml", ".yml"):
        parser.error(f"--config {path}: SGLang's config file is YAML (.yaml or .yml)")
    try:
        with open(path, "rb") as file:
            data = load_yaml(file.read(MAX_CONFIG_BYTES + 1), path, max_bytes=MAX_CONFIG_BYTES)
    except OSError as error:
        parser.error(f"--config {path}: {error.strerror or error}")
    except BoundaryError as error:
        parser.error(f"--config {path}: {error}")
    if data is None:
        data = {}
    if not isinstance(data, dict):
        parser.error(f"--config {path}: expected a mapping of flag names to values, got {type(data).__name__}")
    switches = {action.dest for action in parser._actions if isinstance(action, argparse._StoreTrueAction)}
    merged: list[str] = []
    for key, value in data.items():
        merged += _flag_tokens(parser, path, str(key), value, switches)
    return merged + rest


def _flag_tokens(parser: argparse.ArgumentParser, path: str, key: str, value: JsonValue, switches: set[str]) -> list[str]:
    flag = "--" + key.replace("_", "-")
    if isinstance(value, bool):
        if key.replace("-", "_") not in switches:
            parser.error(f"--config {path}: {key}: true/false is for a switch")
        return [flag] if value else []
    if isinstance(value, list):
        return [flag, *map(str, value)] if value else []
    if isinstance(value, dict) or value is None:
        parser.error(f"--config {path}: {key}: expected a value, got {type(value).__name__}")
    return [f"{flag}={value}"]  # one token: a value starting with '-' stays the value


def parse_args(argv: list[str] | None) -> EngineArgs:
    import sys

    parser = build_parser()
    ns = parser.parse_args(config_file_args(parser, list(sys.argv[1:] if argv is None else argv)))
    if ns.api_key is not None and (problem := key_problem(ns.api_key)):
        parser.error(f"--api-key {problem}")
    if problem := exposure_problem(ns.host, has_key=ns.api_key is not None, allowed=ns.allow_unauthenticated,
                                   host_flag="--host", key_flag="--api-key"):
        parser.error(problem)
    if ns.tp_size != 1:
        parser.error(f"--tp-size {ns.tp_size}: the engine runs one process; use --tp-size 1")
    if ns.max_running_requests < 1:
        parser.error("--max-running-requests must be >= 1")
    if ns.context_length is not None and ns.context_length < 2:
        parser.error("--context-length must be >= 2")
    if not 0 <= ns.port < 65536:
        parser.error(f"--port {ns.port} is not a TCP port")
    if ns.max_n < 1:
        parser.error(f"--max-n must be >= 1, got {ns.max_n}")
    if ns.max_seqs_per_request < ns.max_n:
        parser.error(
            f"--max-seqs-per-request ({ns.max_seqs_per_request}) must be >= --max-n ({ns.max_n})"
        )
    if ns.max_request_bytes < 1024:
        parser.error(f"--max-request-bytes must be >= 1024, got {ns.max_request_bytes}")
    if ns.max_message_bytes < 1:
        parser.error(f"--max-message-bytes must be >= 1, got {ns.max_message_bytes}")
    if ns.log_probs_chunk_size is not None and ns.rl_on_policy_target is None:
        parser.error("--log-probs-chunk-size is the rescoring's chunk: it needs --rl-on-policy-target fsdp")
    device = resolve_device(parser, ns.device, ns.base_gpu_id)
    # every field is the flag of its name, but for the few the parser's value is resolved for
    resolved = {"tokenizer_path": ns.tokenizer_path or ns.model_path, "dtype": _DTYPES[ns.dtype], "device": device,
                "enable_deterministic_inference": ns.enable_deterministic_inference
                or ns.rl_on_policy_target is not None}
    return EngineArgs(**{f.name: resolved[f.name] if f.name in resolved else getattr(ns, f.name)
                         for f in fields(EngineArgs)})


def model_path_problem(model_path: str) -> str | None:
    """Why a local --model-path cannot hold a Hugging Face model, or None (a hub id is left to the loader).
    `main` checks it before torch is imported: a bad path fails in a fraction of a second, not after the imports."""
    path = Path(model_path)
    if path.is_dir():
        return None if (path / "config.json").is_file() else "no config.json in that directory"
    if path.is_absolute() or model_path.startswith("."):
        return "no such directory" if not path.exists() else "not a directory"
    return None
