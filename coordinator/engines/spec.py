"""What launching an engine or the router needs before any process starts: ports, the launch spec, log paths.

Owns: the ports this process handed out in the last minute (`free_port` never hands one out twice) and the
`EngineLaunchSpec` the placement plan builds per engine.
Invariants: importing it imports no HTTP client and starts nothing, so the placement plan, the dry run and a
replay run can use it (`coordinator.engines.launch` starts the processes); no secret is on an engine's command
line (`ps` shows command lines to every user): the API key and every secret-looking passthrough flag go in the
0600 YAML file the command names with `--config` (SGLang's config file, which our engine reads too).
"""

from __future__ import annotations

import logging
import socket
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from coordinator.config.sglang_file import argv_groups

if TYPE_CHECKING:
    from coordinator.config import ClusterConfig, SglangConfig

log = logging.getLogger("rayless")

#: Ports handed out by this process recently; a second launch in the same moment must not get the same one.
_RESERVED: dict[int, float] = {}
_RESERVE_SECONDS = 60.0


def port_is_free(host: str, port: int) -> bool:
    """Whether a server could bind `host:port` now (as servers bind: with SO_REUSEADDR)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def claim_port(host: str, planned: int | None, *, what: str) -> int:
    """The planned port when it is free, else another free one — and a warning saying so."""
    if planned is None:
        return free_port(host)
    if port_is_free(host, planned):
        return planned
    port = free_port(host)
    log.warning("%s: planned port %d on %s is in use; using port %d instead", what, planned, host, port)
    return port


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago and not handed out by this process in the last minute.

    Binding port 0 and releasing it is racy against other processes; launches retry on address-in-use.
    """
    now = time.monotonic()
    for port, t in list(_RESERVED.items()):
        if now - t > _RESERVE_SECONDS:
            del _RESERVED[port]
    for _ in range(100):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        if port not in _RESERVED:
            _RESERVED[port] = now
            return port
    raise RuntimeError("could not find a free port")


#: What a command line shows for the secrets file before a launch writes one (the plan, `--dry-run`).
SECRETS_FILE_SHOWN = "<0600 file: {}>"

#: "rayless": our engine (`workers.engine`, CPU or CUDA); "sglang": `sglang.launch_server`.
ENGINE_KINDS = ("rayless", "sglang")


@dataclass(frozen=True)
class EngineLaunchSpec:
    """How to start one local engine (the placement plan builds one per engine; tests build their own).

    kind: "rayless" runs our engine (`python -m workers.engine`; its device is in `extra_args`), "sglang" runs
    `python -m sglang.launch_server`. extra_args: appended verbatim (the `--sglang-*` passthrough for SGLang,
    engine flags for ours). env: set on top of the coordinator's environment (CUDA_VISIBLE_DEVICES).
    port: the planned port, tried first (another is taken, and said so, when it is in use).
    tp_size: the engine's tensor-parallel ranks (SGLang's `--tp-size`): each joins a weight-update group.
    """

    kind: str
    model_path: str
    host: str = "127.0.0.1"
    api_key: str | None = None
    admin_api_key: str | None = None
    extra_args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    port: int | None = None
    tp_size: int = 1
    start_timeout: float = 300.0
    stop_grace: float = 10.0
    python: str = field(default=sys.executable)

    def __post_init__(self) -> None:
        if self.tp_size < 1:
            raise ValueError(f"an engine's tp_size must be >= 1, got {self.tp_size}")
        if self.kind not in ENGINE_KINDS:
            raise ValueError(f"engine kind must be one of {', '.join(ENGINE_KINDS)}, got {self.kind!r}")

    def secrets(self) -> dict[str, str]:
        """The flags kept off the command line, by name (`api-key`, and any secret-looking passthrough flag):
        what the launch writes to the 0600 file the command names."""
        from coordinator.config.secrets import split_secret_flags

        found = split_secret_flags(self.extra_args)[1]
        keys = {"api-key": self.api_key, "admin-api-key": self.admin_api_key}
        return {**{name: value for name, value in keys.items() if value}, **found}

    def command(self, port: int, *, secrets_file: str | None = None) -> list[str]:
        """The engine's command line; with secrets, `--config FILE` names the file that holds them
        (`secrets_file`: the launch's; else a placeholder saying what it will hold)."""
        from coordinator.config.secrets import split_secret_flags

        module = "workers.engine" if self.kind == "rayless" else "sglang.launch_server"
        cmd = [
            self.python,
            "-m",
            module,
            "--model-path",
            str(self.model_path),
            "--host",
            self.host,
            "--port",
            str(port),
        ]
        secrets = self.secrets()
        if secrets:
            cmd += ["--config", secrets_file or SECRETS_FILE_SHOWN.format(", ".join(secrets))]
        return cmd + split_secret_flags(self.extra_args)[0]


def engine_launch_spec(*, model_path: str, sglang: SglangConfig, cluster: ClusterConfig, seed: int,
                       enable_metrics: bool, backend: str = "rayless", device: str = "cpu",
                       gpus: Sequence[int] = (), visible_devices: str | None = None,
                       port: int | None = None, release_memory: bool = False,
                       spill_dir: str | None = None, gpus_per_engine: int | None = None,
                       overrides: Sequence[str] = ()) -> EngineLaunchSpec:
    """How the run launches one engine (rollout or eval), from the sglang and cluster slices and its placement.

    `backend`/`device`: the plan's choice (`coordinator.plan.backend`). `gpus`: the engine's GPU positions
    among those the coordinator sees. SGLang gets `--tp-size`, `--base-gpu-id` (its first GPU; it inherits the
    coordinator's CUDA_VISIBLE_DEVICES) and the `--sglang-*` passthrough; our engine gets our flags (seed,
    request slots) and `--device`: on CUDA it sees only its GPU (`visible_devices` as CUDA_VISIBLE_DEVICES)
    and runs on `--base-gpu-id 0`. `enable_metrics`: the health monitor tells slow from hung by /metrics.
    `release_memory`: the run releases the engine's memory each step (`--offload-rollout`), which SGLang allows
    only with `--enable-memory-saver`; `spill_dir`: where our CPU engine writes released weights.
    `gpus_per_engine`: the group's TP size (default `--rollout-num-gpus-per-engine`; the eval fleet's is
    `--eval-num-gpus-per-engine`); `overrides`: miles' `--eval-sglang-*` for the eval fleet, or the engine's
    `--sglang-config` server group's overrides, each replacing the inherited `--sglang-*` value of the same name
    (`override_args`).
    """
    extra: list[str] = ["--weight-version", "0"]
    env: tuple[tuple[str, str], ...] = ()
    # a --sglang-config group's own context_length replaces the run's (SGLang would take the last of two)
    if sglang.sglang_context_length and not (backend == "sglang" and "--context-length" in overrides):
        extra += ["--context-length", str(sglang.sglang_context_length)]
    if enable_metrics:
        extra.append("--enable-metrics")
    tp_size = 1
    if backend == "sglang":
        tp_size = gpus_per_engine or cluster.rollout_num_gpus_per_engine
        extra += ["--tp-size", str(tp_size)]
        if gpus:
            extra += ["--base-gpu-id", str(gpus[0])]
        passthrough = override_args(sglang.sglang_passthrough, overrides)
        extra += passthrough
        if release_memory and "--enable-memory-saver" not in passthrough:
            extra.append("--enable-memory-saver")
    else:
        extra += ["--random-seed", str(seed), "--max-running-requests", str(sglang.sglang_server_concurrency)]
        if device == "cuda":
            if len(gpus) != 1 or not visible_devices:
                raise ValueError(f"our engine on CUDA runs on exactly one GPU, got positions {list(gpus)}")
            extra += ["--device", "cuda", "--base-gpu-id", "0"]
            env = (("CUDA_VISIBLE_DEVICES", visible_devices),)
        else:
            extra += ["--device", "cpu"]
        if spill_dir is not None:
            extra += ["--weight-spill-dir", spill_dir]
    return EngineLaunchSpec(kind=backend, model_path=model_path, api_key=sglang.sglang_api_key,
                            admin_api_key=sglang.sglang_admin_api_key,
                            extra_args=tuple(extra), env=env, port=port, tp_size=tp_size)


def override_args(base: Sequence[str], overrides: Sequence[str]) -> list[str]:
    """`base` (the `--sglang-*` passthrough) with each flag of `overrides` replacing the one of the same name
    (miles' `--eval-sglang-*` inherit-then-override); `--no-X` drops an inherited `--X` (and sets nothing)."""
    replaced = {group[0] for group in argv_groups(overrides)}
    dropped = {"--" + flag[len("--no-"):] for flag in replaced if flag.startswith("--no-")}
    kept = [group for group in argv_groups(base) if group[0] not in replaced and group[0] not in dropped]
    added = [group for group in argv_groups(overrides) if not group[0].startswith("--no-")]
    return [token for group in kept + added for token in group]


def engine_log_path(run_dir: Path, name: str) -> Path:
    return Path(run_dir) / "logs" / f"engine-{name}.log"


def router_command(*, python: str, host: str, port: int, prometheus_port: int, policy: str,
                   extra_args: Sequence[str] = ()) -> list[str]:
    """The sglang-router command line (both ports always given: their defaults collide)."""
    return [
        python, "-m", "sglang_router.launch_router",
        "--host", host, "--port", str(port),
        "--prometheus-host", host, "--prometheus-port", str(prometheus_port),
        "--policy", policy,
        *extra_args,
    ]  # fmt: skip


def router_log_path(run_dir: Path, name: str) -> Path:
    return Path(run_dir) / "logs" / f"router-{name}.log"
