"""Which engine each launched engine group runs, and on which device: `--engine-backend` resolved.

Owns the one rule, per group (rollout, eval):

- a group sized in engines (`--rollout-num-engines`, `--eval-num-engines`) runs our engine on the CPU;
- a group sized in GPUs (`--rollout-num-gpus`, `--eval-num-gpus`) runs on GPUs: SGLang with `sglang`, our
  engine on CUDA with `rayless`, and with `auto` SGLang where the `sglang` package is importable, else our
  engine on CUDA (so a GPU machine with torch but no SGLang runs the whole loop on the GPU);
- `--engine-backend cpu` runs our engine on the CPU whatever sizes the group (as before GPUs were planned).

Invariant: a choice that cannot run raises `ConfigError` naming the flags (exit 2) — SGLang sized in CPU
engines, our engine with more than one GPU per engine — or, where only this machine is lacking (no `sglang`
package on a login node), raises in a launch and becomes a warning in `--dry-run` (`lenient`).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

from coordinator.config.fields import ConfigError
from coordinator.config.settings import Config
from coordinator.config.sglang_file import Deployment, deployment


@dataclass(frozen=True)
class EngineChoice:
    """What one engine group runs: `backend` "sglang" or "rayless" (our engine), `device` "cuda" or "cpu"."""

    backend: str
    device: str
    #: why, in words, for the plan's printout
    reason: str

    @property
    def on_gpu(self) -> bool:
        return self.device == "cuda"


def sglang_installed() -> bool:
    """Whether `python -m sglang.launch_server` can start here (found without importing it)."""
    try:
        return importlib.util.find_spec("sglang") is not None
    except (ImportError, ValueError):
        return False


def choose_engines(config: Config, *, has_sglang: bool, lenient: bool = False
                   ) -> tuple[EngineChoice | None, EngineChoice | None, list[str]]:
    """(rollout group's choice, eval group's choice, warnings); None for a group that launches no engine."""
    warnings: list[str] = []
    rollout = eval_ = None
    groups = deployment(config) if config.sglang.sglang_config is not None else None
    if config.num_launched_rollout_engines:
        sized_in_gpus = config.cluster.rollout_num_gpus is not None
        flag = "--rollout-num-gpus" if sized_in_gpus else "--rollout-num-engines"
        rollout = _choose(config, flag, sized_in_gpus, has_sglang=has_sglang, lenient=lenient, warnings=warnings,
                          sizing=_sizing(groups, "rollout", config.cluster.rollout_num_gpus_per_engine,
                                         "--rollout-num-gpus-per-engine"))
    if config.num_eval_engines:
        sized_in_gpus = config.eval.eval_num_gpus > 0
        flag = "--eval-num-gpus" if sized_in_gpus else "--eval-num-engines"
        eval_ = _choose(config, flag, sized_in_gpus, has_sglang=has_sglang, lenient=lenient, warnings=warnings,
                        sizing=_sizing(groups, "eval", config.eval.eval_num_gpus_per_engine,
                                       "--eval-num-gpus-per-engine"))
    return rollout, eval_, list(dict.fromkeys(warnings))


def _sizing(groups: Deployment | None, group: str, per_engine: int, flag: str) -> tuple[int, str]:
    """The group's largest engine and what set it: an `--sglang-config` group's `num_gpus_per_engine`, or
    the flag (our engine on CUDA runs one GPU per engine, so the largest decides)."""
    if groups is None or not groups.groups_of(group):
        return per_engine, flag
    size = groups.max_engine_size(group)
    if size == per_engine:
        return per_engine, flag
    return size, f"{groups.source}: a server group's num_gpus_per_engine"


def _choose(config: Config, flag: str, sized_in_gpus: bool, *, has_sglang: bool, lenient: bool,
            warnings: list[str], sizing: tuple[int, str]) -> EngineChoice:
    """`sizing`: the group's GPUs per engine and the flag that sets them."""
    asked = config.cluster.engine_backend
    per_engine, per_flag = sizing
    if asked == "cpu":
        return EngineChoice("rayless", "cpu", "--engine-backend cpu: our engine on the CPU")
    if not sized_in_gpus:
        if asked == "sglang":
            raise ConfigError(f"--engine-backend sglang runs on GPUs, but {flag} sizes the fleet in CPU engines: "
                              f"size it in GPUs ({flag.replace('engines', 'gpus')}), or use --engine-backend "
                              "rayless/cpu for our engine on the CPU")
        return EngineChoice("rayless", "cpu", f"{flag} (engines, not GPUs): our engine on the CPU")
    if asked == "rayless" and per_engine > 1:
        raise ConfigError(f"--engine-backend rayless: our engine runs on one GPU, but {per_flag} "
                          f"is {per_engine}: tensor parallelism needs SGLang (--engine-backend sglang), or use 1")
    if asked == "rayless":
        return EngineChoice("rayless", "cuda", "--engine-backend rayless: our engine on CUDA")
    if has_sglang:
        why = "--engine-backend sglang" if asked == "sglang" else "--engine-backend auto: sglang is installed"
        return EngineChoice("sglang", "cuda", why)
    missing = "the sglang package is not importable here (pip install 'sglang[all]')"
    if asked == "sglang" or per_engine > 1:
        reason = ("--engine-backend sglang" if asked == "sglang"
                  else f"{per_flag} {per_engine}: tensor parallelism needs SGLang")
        if not lenient:
            raise ConfigError(f"{reason}, but {missing}; our engine on CUDA (--engine-backend rayless) runs one GPU "
                              "per engine")
        warnings.append(f"{reason}, but {missing}: the launch will fail on a node without it")
        return EngineChoice("sglang", "cuda", reason)
    if lenient:
        warnings.append(f"--engine-backend auto: {missing}, so this plan runs our engine on CUDA; on a node "
                        "with sglang installed, auto picks SGLang")
    return EngineChoice("rayless", "cuda", f"--engine-backend auto: {missing}, so our engine on CUDA")
