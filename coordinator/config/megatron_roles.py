"""`--megatron-config-path`: slime's YAML of per-role overrides (actor, critic) on top of the command line.

Owns the schema of that file (slime's `parse_megatron_role_args` / `_apply_megatron_role_overrides`) and what
each key becomes here:

    megatron:
      - {name: default, role: actor, overrides: {lr: 1e-6, weight_decay: 0.1, tensor_model_parallel_size: 2}}
      - {name: default, role: critic, overrides: {lr: 1e-5}}     # `args`: slime's older name of `overrides`

- an actor key naming a flag of rayless (`lr`, `global_batch_size`, `micro_batch_size`, `save`, ...) sets that
  flag, over the command line (slime: the role's YAML wins over the shared CLI), through the flag's own checks;
  a key naming a Megatron-LM or slime/miles flag rayless accepts and does not use (`tensor_model_parallel_size`,
  ...) is accepted and named in the porting notice like the flag; `num_nodes` / `num_gpus_per_node` are
  ignored, as slime ignores them (placement follows the command line);
- a critic key `K` sets rayless' `--critic-K` flag (`lr` → `--critic-lr`, `load` → `--critic-load`) in a run
  that trains a critic (`--advantage-estimator ppo`, as slime builds the critic's args only then); in any other
  run the critic entry is not read, as in slime.
Invariants: a key rayless cannot honour is refused naming the file, the role and the key — with the flag's own
reason when slime/miles have it and rayless refuses it, as "no slime/miles/Megatron-LM flag" only when no
upstream version has it; values meet the flags' own types, choices and ranges.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from coordinator.config.fields import ConfigError, convert

FLAG = "--megatron-config-path"
ROLES = ("actor", "critic")
_ENTRY_KEYS = ("name", "role", "overrides", "args")
#: slime's `ignored_keys`: GPU allocation always follows the command line
PLACEMENT_KEYS = ("num_nodes", "num_gpus_per_node")
MAX_FILE_BYTES = 1 << 20


@dataclass(frozen=True)
class RoleOverrides:
    """What the file did, for the porting notice: flags set, keys accepted and not used, keys ignored."""

    source: str
    set_flags: tuple[tuple[str, str], ...] = ()  # (role, --flag)
    unused: tuple[str, ...] = ()  # "actor.tensor_model_parallel_size"
    placement: tuple[str, ...] = ()  # "critic.num_gpus_per_node"
    skipped_critic: bool = False

    def notice(self) -> str:
        parts = []
        if self.set_flags:
            parts.append("sets " + " ".join(f"{flag} ({role})" for role, flag in self.set_flags))
        if self.unused:
            parts.append("accepted, not used (FSDP2): " + " ".join(self.unused))
        if self.placement:
            parts.append("ignored as slime ignores them (placement follows the command line): "
                         + " ".join(self.placement))
        if self.skipped_critic:
            parts.append("its critic entry is not read: this run trains no critic (slime reads it for PPO only)")
        return f"{self.source}: " + ("; ".join(parts) if parts else "no overrides")


@functools.lru_cache(maxsize=8)
def _read(path: str, stamp: tuple[int, int]) -> dict[str, dict[str, Any]]:
    from coordinator.config.yaml_files import load_config_yaml

    source = f"{FLAG} {path}"
    try:
        if Path(path).stat().st_size > MAX_FILE_BYTES:
            raise ConfigError(f"{source}: larger than {MAX_FILE_BYTES} bytes; a role config is small text")
        text = Path(path).read_bytes()
    except OSError as error:
        raise ConfigError(f"{source}: cannot be read: {error.strerror or error}") from None
    data = load_config_yaml(text, source) or {}
    if not isinstance(data, Mapping) or "megatron" not in data:
        raise ConfigError(f"{source}: must contain a top-level 'megatron' list, e.g. megatron: [{{name: default, "
                          "role: actor, overrides: {...}}] (slime)")
    entries = data["megatron"]
    if not isinstance(entries, list):
        raise ConfigError(f"{source}: megatron: must be a list of role entries (slime)")
    roles: dict[str, dict[str, Any]] = {}
    for index, entry in enumerate(entries):
        where = f"megatron[{index}]"
        if not isinstance(entry, Mapping):
            raise ConfigError(f"{source}: {where}: a role entry is a mapping (name, role, overrides)")
        for key in entry:
            if key not in _ENTRY_KEYS:
                raise ConfigError(f"{source}: {where}.{key}: not a key of slime's role entries "
                                  f"({', '.join(_ENTRY_KEYS)})")
        role = entry.get("role")
        if role not in ROLES:
            raise ConfigError(f"{source}: {where}.role: must be actor or critic (slime's roles), got {role!r}")
        if role in roles:
            raise ConfigError(f"{source}: {where}: a second entry with role={role} (slime takes at most one)")
        overrides = entry.get("overrides") or entry.get("args") or {}
        if not isinstance(overrides, Mapping) or not all(isinstance(key, str) for key in overrides):
            raise ConfigError(f"{source}: {where}.overrides: must map argument names (argparse attribute names, "
                              "e.g. tensor_model_parallel_size) to values")
        roles[role] = dict(overrides)
    return roles


def read_roles(path: str) -> dict[str, dict[str, Any]]:
    """The overrides of each role given in the file (read once per content)."""
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"{FLAG} {path}: no such file")
    status = file.stat()
    return _read(str(file), (status.st_mtime_ns, status.st_size))


def apply_megatron_config(values: dict[str, Any], path: str) -> tuple[dict[str, Any], RoleOverrides]:
    """`values` (converted flags by field name) with the file's role overrides applied, and what it did."""
    from coordinator.config.flags import FLAGS
    from coordinator.config.upstream import upstream_rows

    source = f"{FLAG} {path}"
    rows = upstream_rows()
    values = dict(values)
    set_flags: list[tuple[str, str]] = []
    unused: list[str] = []
    placement: list[str] = []
    roles = read_roles(path)
    estimator = values.get("advantage_estimator", FLAGS["advantage_estimator"][1].default)
    trains_critic = estimator == "ppo"
    for role, overrides in roles.items():
        if role == "critic" and not trains_critic:
            continue
        for key, raw in overrides.items():
            where = f"{source}: role {role}: {key}"
            name = key.replace("-", "_")
            if name in PLACEMENT_KEYS:
                placement.append(f"{role}.{key}")
                continue
            target = name if role == "actor" else (name if name.startswith("critic_") else f"critic_{name}")
            row = rows.get("--" + target.replace("_", "-"))
            if target in FLAGS:
                values[target] = _value(FLAGS[target][1], raw, where)
                if FLAGS[target][0] == "megatron":  # accepted and not used, as on the command line
                    unused.append(f"{role}.{key}")
                else:
                    set_flags.append((role, FLAGS[target][1].flag))
            elif (row is not None and row.disposition == "ignored") or (role == "critic"
                                                                         and _megatron_ignored(name, rows)):
                unused.append(f"{role}.{key}")
            elif row is not None and row.disposition == "refused":
                raise ConfigError(f"{where}: sets {row.flag}, which rayless refuses: {row.note}")
            elif row is not None:
                raise ConfigError(f"{where}: {row.flag} is not a per-role training argument in rayless: give it on "
                                  "the command line")
            elif role == "critic":
                raise ConfigError(f"{where}: rayless' critic has no --{target.replace('_', '-')} flag")
            else:
                raise ConfigError(f"{where}: no slime/miles/Megatron-LM argument of that name (upstream_flags.tsv "
                                  "lists every version's); keys are argparse attribute names, e.g. "
                                  "tensor_model_parallel_size")
    return values, RoleOverrides(source=source, set_flags=tuple(set_flags), unused=tuple(unused),
                                 placement=tuple(placement), skipped_critic="critic" in roles and not trains_critic)


def _value(spec: Any, raw: Any, where: str) -> Any:
    """The flag's value from YAML, through the flag's own converter; null is no value (as in `--config`)."""
    if raw is None:
        raise ConfigError(f"{where}: null is not a value for {spec.flag}; omit the key to keep the flag's value")
    return convert(spec, raw, where)


def _megatron_ignored(name: str, rows: Mapping[str, Any]) -> bool:
    """A critic key naming a Megatron argument rayless accepts and does not use (parallelism, kernels, ...)."""
    from coordinator.config.megatron import CATEGORY_OF

    row = rows.get("--" + name.replace("_", "-"))
    return name in CATEGORY_OF or (row is not None and row.disposition == "ignored")


def describe(config: Any) -> str | None:
    """The porting notice's line for `--megatron-config-path`, or None without it."""
    path = config.train.megatron_config_path
    if path is None:
        return None
    return apply_megatron_config(dict(_explicit(config)), path)[1].notice()


def _explicit(config: Any) -> dict[str, Any]:
    return {"advantage_estimator": config.rollout.advantage_estimator}
