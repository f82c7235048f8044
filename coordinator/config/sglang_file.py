"""`--sglang-config`: slime's and miles' YAML of SGLang server groups, mapped onto rayless' engine groups.

Owns the schema of that file (miles' `SglangConfig.from_yaml` / `ModelConfig.resolve`, slime's the same), its
reading through the boundary's safe YAML loader, and the mapping:

    sglang:
      - name: actor                      # the policy: rayless' rollout engine group
        model_path: /models/x-fp8        # optional; differing from --hf-checkpoint needs `update_weights: true`
        num_gpus_per_engine: 1           # optional; default --rollout-num-gpus-per-engine
        server_groups:                   # (`engine_groups`: miles' older name)
          - {worker_type: regular, num_gpus: 4, overrides: {mem_fraction_static: 0.7}}
          - {worker_type: regular, num_gpus: 4, overrides: {mem_fraction_static: 0.8, chunked_prefill_size: 4096}}
      - name: eval                       # miles' eval fleet (--eval-num-gpus): rayless' eval engine group
        server_groups: [{worker_type: regular, num_gpus: 2}]

A model's server groups are consecutive blocks of its GPUs, in file order (slime's `gpu_offset`): a regular
group launches `num_gpus / num_gpus_per_engine` engines of its own size (`num_gpus_per_engine`: the group's,
else the model's, else `--rollout-num-gpus-per-engine` / the eval fleet's `--eval-num-gpus-per-engine`; SGLang's
`--tp-size`), a `placeholder` group launches none but keeps its GPUs out of use (slime: "reserves GPU slots
without creating engines"). The launched engines are numbered across the groups in order (engine i belongs to
the group holding the i-th launched engine); each group's `overrides` (SGLang `ServerArgs` field names) become
its engines' `--flag value` arguments on top of the inherited `--sglang-*` ones (the eval model: on top of
`--eval-sglang-*`, as miles' "YAML > --eval-sglang-* > --sglang-*"). Sizes are checked as slime and miles check
them: the policy's groups, placeholders included, add up to `--rollout-num-gpus` and the eval model's to
`--eval-num-gpus`. With CPU engines (`--rollout-num-engines`, `--eval-num-engines`) those flags stand in for the
GPU counts: a group's `num_gpus` counts CPU units and `num_gpus_per_engine` how many units one engine takes
(our CPU engine has no tensor parallelism, so a larger engine is still one process), so the file launches
exactly as many engines as on GPUs.

Invariants: what rayless cannot do is refused naming the file and the key (`sglang[0].server_groups[1].
worker_type: prefill ...`), never ignored — prefill/decode and encoder groups, a second (frozen) model, groups
of different sizes or placeholders on a multi-node run (rayless splits a fleet over the nodes by engine count),
a model of placeholders only, an override of what rayless itself puts on an engine's command line (`tp_size`,
`port`, `api_key`, SGLang's own `config` file, ...); an override never reaches a command line as a secret
(`api_key`-like keys are refused: the keys have their flags, which keep them in a 0600 file). Overrides reach
SGLang only, as `--sglang-*` flags do.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from coordinator.config.cluster import ClusterConfig
from coordinator.config.evaluation import EvalConfig
from coordinator.config.fields import ConfigError
from coordinator.config.rollout import RolloutConfig
from coordinator.config.sglang import SglangConfig
from coordinator.config.yaml_files import load_config_yaml


class RunConfig(Protocol):
    """The parts of a run's `Config` the mapping reads (a Protocol, so `settings`, which sizes its engine
    fleets from the mapping, and this module do not import each other)."""

    @property
    def cluster(self) -> ClusterConfig: ...
    @property
    def sglang(self) -> SglangConfig: ...
    @property
    def rollout(self) -> RolloutConfig: ...
    @property
    def eval(self) -> EvalConfig: ...
    @property
    def needs_engines(self) -> bool: ...

FLAG = "--sglang-config"
MAX_FILE_BYTES = 1 << 20
WORKER_TYPES = ("regular", "prefill", "decode", "placeholder", "encoder")  # encoder: slime's (EPD)
_MODEL_KEYS = ("name", "model_path", "num_gpus_per_engine", "server_groups", "engine_groups", "update_weights")
_GROUP_KEYS = ("worker_type", "num_gpus", "num_gpus_per_engine", "overrides")
#: `overrides` keys rayless puts on the command line itself: refused, with what to use instead.
OWNED_OVERRIDES = {
    "tp_size": "the group's num_gpus_per_engine is its TP size",
    "base_gpu_id": "the placement plan chooses each engine's GPUs",
    "host": "the plan chooses where engines listen (127.0.0.1, or the node's address on multi-node runs)",
    "port": "the plan chooses each engine's port",
    "api_key": "give --sglang-api-key (kept off command lines, in a 0600 file)",
    "admin_api_key": "give --sglang-admin-api-key (kept off command lines, in a 0600 file)",
    "config": "SGLang's own --config file is the one rayless writes (0600, for the API key): put these settings "
              "in the group's overrides instead",
    "weight_version": "rayless numbers the weight versions",
    "random_seed": "give --rollout-seed",
    "nnodes": "an engine spans one node in rayless",
    "node_rank": "an engine spans one node in rayless",
    "dist_init_addr": "an engine spans one node in rayless",
    "nccl_port": "the launcher chooses the engines' ports",
    "gpu_id_step": "the placement plan chooses each engine's GPUs",
}
_KEY = re.compile(r"^[a-z][a-z0-9_]*$")


@dataclass(frozen=True)
class ServerGroup:
    """One server group of the file, resolved: `engines` consecutive engines of `gpus_per_engine` GPUs (CPU
    units) each, launched with `overrides` on top of the inherited `--sglang-*` arguments; a placeholder group
    holds its `num_gpus` and launches nothing."""

    where: str  # "sglang[0].server_groups[1]", for messages
    num_gpus: int
    gpus_per_engine: int
    overrides: tuple[str, ...]
    placeholder: bool = False

    @property
    def engines(self) -> int:
        return 0 if self.placeholder else self.num_gpus // self.gpus_per_engine


#: One group as read from the file: (where, num_gpus, num_gpus_per_engine or None, overrides argv,
#: overrides' model_path or None, placeholder).
GroupEntry = tuple[str, int, int | None, tuple[str, ...], str | None, bool]


@dataclass(frozen=True)
class ModelEntry:
    where: str
    name: str
    model_path: str | None
    num_gpus_per_engine: int | None
    update_weights: bool | None
    groups: tuple[GroupEntry, ...]


@dataclass(frozen=True)
class Deployment:
    """The file mapped onto rayless' engine groups."""

    source: str
    rollout: tuple[ServerGroup, ...]
    eval: tuple[ServerGroup, ...]
    #: the policy's `model_path` when it differs from --hf-checkpoint (served with update_weights: true)
    rollout_model_path: str | None = None

    def groups_of(self, group: str) -> tuple[ServerGroup, ...]:
        return self.rollout if group == "rollout" else self.eval if group == "eval" else ()

    def engine_count(self, group: str) -> int:
        """Engines the file launches in `group` ("rollout" or "eval"); placeholders launch none."""
        return sum(server_group.engines for server_group in self.groups_of(group))

    def span(self, group: str) -> int:
        """GPUs (CPU units) `group` holds, placeholders included."""
        return sum(server_group.num_gpus for server_group in self.groups_of(group))

    def layout(self, group: str) -> tuple[tuple[int, int], ...]:
        """(first GPU offset within the group's GPUs, GPUs) of each launched engine of `group`, in engine order:
        a placeholder group leaves its GPUs as a gap (slime's `engine_gpu_offsets`)."""
        found: list[tuple[int, int]] = []
        offset = 0
        for server_group in self.groups_of(group):
            found += [(offset + i * server_group.gpus_per_engine, server_group.gpus_per_engine)
                      for i in range(server_group.engines)]
            offset += server_group.num_gpus
        return tuple(found)

    def max_engine_size(self, group: str) -> int:
        return max((server_group.gpus_per_engine for server_group in self.groups_of(group)
                    if server_group.engines), default=1)

    def _group_of(self, group: str, index: int) -> ServerGroup | None:
        start = 0
        for server_group in self.groups_of(group):
            if index < start + server_group.engines:
                return server_group
            start += server_group.engines
        return None

    def overrides_of(self, group: str, index: int) -> tuple[str, ...]:
        """The overrides of engine `index` (0-based over the launched engines) of `group` ("rollout", "eval")."""
        found = self._group_of(group, index)
        return found.overrides if found is not None else ()

    def size_of(self, group: str, index: int) -> int | None:
        """GPUs (SGLang's `--tp-size`) of engine `index` of `group`; None past the file's engines."""
        found = self._group_of(group, index)
        return found.gpus_per_engine if found is not None else None


def _fail(source: str, where: str, reason: str) -> ConfigError:
    return ConfigError(f"{source}: {where}: {reason}")


def override_argv(overrides: Any, source: str, where: str) -> tuple[str, ...]:
    """`overrides` (ServerArgs field names → values) as sglang.launch_server arguments: `key: v` → `--key v`,
    `true` → `--key`, `false`/null → `--no-key` (drops an inherited `--key`: SGLang's switches are off unless
    given), a list → `--key v1 v2`, a mapping → its JSON (SGLang's JSON-valued arguments)."""
    from coordinator.config.secrets import split_secret_flags

    if overrides is None:
        return ()
    if not isinstance(overrides, Mapping):
        raise _fail(source, f"{where}.overrides", "must be a mapping of SGLang ServerArgs field names to values")
    argv: list[str] = []
    for key, value in overrides.items():
        if not isinstance(key, str) or not _KEY.match(key):
            raise _fail(source, f"{where}.overrides", f"{key!r} is not a ServerArgs field name (snake_case)")
        here = f"{where}.overrides.{key}"
        if key in OWNED_OVERRIDES:
            raise _fail(source, here, f"not overridable per group in rayless: {OWNED_OVERRIDES[key]}")
        if key == "model_path":
            continue  # the group's model path: read by `_read_model`
        flag = "--" + key.replace("_", "-")
        if value is True:
            argv.append(flag)
        elif value is False or value is None:
            argv.append("--no-" + key.replace("_", "-"))
        elif isinstance(value, (list, tuple)):
            if not value or any(isinstance(item, (Mapping, list)) for item in value):
                raise _fail(source, here, "a list override must hold plain values")
            argv += [flag, *(str(item) for item in value)]
        elif isinstance(value, Mapping):
            argv += [flag, json.dumps(value)]
        else:
            argv += [flag, str(value)]
    if split_secret_flags(argv)[1]:
        raise _fail(source, f"{where}.overrides", "a key or secret-looking setting in a YAML file passed to a "
                    "command line: give it as a --sglang-* flag, which rayless keeps in a 0600 file")
    return tuple(argv)


def _int(value: Any, source: str, where: str, *, optional: bool = False) -> int | None:
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise _fail(source, where, f"must be a positive integer, got {value!r}")
    return value


def _read_group(raw: Any, source: str, where: str) -> GroupEntry:
    if not isinstance(raw, Mapping):
        raise _fail(source, where, "a server group is a mapping (worker_type, num_gpus, num_gpus_per_engine, "
                    "overrides)")
    for key in raw:
        if key not in _GROUP_KEYS:
            raise _fail(source, f"{where}.{key}", f"not a server-group key of slime/miles ({', '.join(_GROUP_KEYS)})")
    worker_type = raw.get("worker_type")
    if worker_type not in WORKER_TYPES:
        raise _fail(source, f"{where}.worker_type", f"must be one of {', '.join(WORKER_TYPES)}, got {worker_type!r}")
    if worker_type in ("prefill", "decode"):
        raise _fail(source, f"{where}.worker_type", f"{worker_type}: prefill/decode disaggregation is not in "
                    "rayless (its engines each serve whole requests): use worker_type regular")
    if worker_type == "encoder":
        raise _fail(source, f"{where}.worker_type", "encoder: slime's separate multimodal encoder servers (EPD) are "
                    "not in rayless (its engines serve text prompts whole)")
    num_gpus = _int(raw.get("num_gpus"), source, f"{where}.num_gpus")
    per_engine = _int(raw.get("num_gpus_per_engine"), source, f"{where}.num_gpus_per_engine", optional=True)
    overrides = raw.get("overrides")
    model_path = overrides.get("model_path") if isinstance(overrides, Mapping) else None
    if model_path is not None and not isinstance(model_path, str):
        raise _fail(source, f"{where}.overrides.model_path", "must be a path")
    assert num_gpus is not None
    return where, num_gpus, per_engine, override_argv(overrides, source, where), model_path, \
        worker_type == "placeholder"


def _read_model(raw: Any, source: str, where: str) -> ModelEntry:
    if not isinstance(raw, Mapping):
        raise _fail(source, where, "a model entry is a mapping (name, model_path, server_groups, ...)")
    for key in raw:
        if key not in _MODEL_KEYS:
            raise _fail(source, f"{where}.{key}", f"not a model key of slime/miles ({', '.join(_MODEL_KEYS)})")
    name = raw.get("name")
    if not isinstance(name, str) or not name:
        raise _fail(source, f"{where}.name", "every model entry needs a name")
    model_path = raw.get("model_path")
    if model_path is not None and not isinstance(model_path, str):
        raise _fail(source, f"{where}.model_path", "must be a path")
    update_weights = raw.get("update_weights")
    if update_weights is not None and not isinstance(update_weights, bool):
        raise _fail(source, f"{where}.update_weights", "must be true or false")
    key = "server_groups" if raw.get("server_groups") else "engine_groups"
    groups = raw.get(key) or []
    if not isinstance(groups, list):
        raise _fail(source, f"{where}.{key}", "must be a list of server groups")
    return ModelEntry(where=where, name=name, model_path=model_path,
                      num_gpus_per_engine=_int(raw.get("num_gpus_per_engine"), source,
                                               f"{where}.num_gpus_per_engine", optional=True),
                      update_weights=update_weights,
                      groups=tuple(_read_group(group, source, f"{where}.{key}[{i}]") for i, group in enumerate(groups)))


def read_models(text: str | bytes, source: str) -> tuple[ModelEntry, ...]:
    """The file's model entries, each checked for shape (sizes and the mapping come later: `deployment`)."""
    data = load_config_yaml(text, source)
    if not isinstance(data, Mapping) or "sglang" not in data:
        raise ConfigError(f"{source}: the top level must be a mapping with an `sglang` key holding the list of "
                          "models (sglang: [{name: actor, server_groups: [...]}])")
    for key in data:
        if key != "sglang":
            raise _fail(source, str(key), "not a key of slime's/miles' sglang config (only `sglang`)")
    models = data["sglang"]
    if not isinstance(models, list) or not models:
        raise _fail(source, "sglang", "must be a non-empty list of model entries")
    entries = tuple(_read_model(model, source, f"sglang[{i}]") for i, model in enumerate(models))
    names = [entry.name for entry in entries]
    for name in names:
        if names.count(name) > 1:
            raise _fail(source, "sglang", f"the model name {name!r} is given twice")
    return entries


@functools.lru_cache(maxsize=8)
def _read_file(path: str, stamp: tuple[int, int]) -> tuple[ModelEntry, ...]:
    source = f"{FLAG} {path}"
    try:
        file = Path(path)
        if file.stat().st_size > MAX_FILE_BYTES:
            raise ConfigError(f"{source}: larger than {MAX_FILE_BYTES} bytes; an sglang config is small text")
        text = file.read_bytes()
    except OSError as error:
        raise ConfigError(f"{source}: cannot be read: {error.strerror or error}") from None
    return read_models(text, source)


def models_of(path: str) -> tuple[ModelEntry, ...]:
    """The model entries of `--sglang-config PATH` (read once per content: an edited file is read again)."""
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"{FLAG} {path}: no such file")
    status = file.stat()
    return _read_file(str(file), (status.st_mtime_ns, status.st_size))


def _resolve(entry: ModelEntry, source: str, *, default_per_engine: int, nodes: int,
             base: Sequence[str] = ()) -> tuple[ServerGroup, ...]:
    """The model's groups with their sizes (slime's `ModelConfig.resolve`: the group's, else the model's, else
    the flag's). On several nodes every engine must be alike and no GPU reserved: each node plans its share
    of the fleet by engine count (`plan.nodes.engine_share`), which has no place for either."""
    groups = []
    for where, num_gpus, per_engine, overrides, _, placeholder in entry.groups:
        size = per_engine or entry.num_gpus_per_engine or default_per_engine
        if not placeholder and num_gpus % size:
            raise _fail(source, f"{where}.num_gpus", f"{num_gpus} is not a multiple of the group's engine size {size}")
        groups.append(ServerGroup(where=where, num_gpus=num_gpus, gpus_per_engine=size,
                                  overrides=_layered(base, overrides), placeholder=placeholder))
    launched = [group for group in groups if not group.placeholder]
    if not launched:
        raise _fail(source, f"{entry.where}.server_groups", "only placeholder groups: the model launches no "
                    "engine (slime would serve it with none)")
    if nodes > 1:
        if reserved := [group for group in groups if group.placeholder]:
            raise _fail(source, f"{reserved[0].where}.worker_type", f"placeholder on --actor-num-nodes {nodes}: "
                        "rayless splits a fleet over the nodes by engine count, so a reserved block of GPUs has "
                        "no node to sit on; drop the group and lower the sizes")
        if len({group.gpus_per_engine for group in launched}) > 1:
            odd = next(group for group in launched if group.gpus_per_engine != launched[0].gpus_per_engine)
            raise _fail(source, f"{odd.where}.num_gpus_per_engine", f"{odd.gpus_per_engine} differs from "
                        f"{launched[0].where}'s {launched[0].gpus_per_engine} on --actor-num-nodes {nodes}: "
                        "rayless splits a fleet over the nodes by engine count, which needs engines of one size")
    return tuple(groups)


def argv_groups(argv: Sequence[str]) -> list[list[str]]:
    """`--flag value ...` groups of a passthrough argv (a token not starting with `--` is a value)."""
    groups: list[list[str]] = []
    for token in argv:
        if token.startswith("--") or not groups:
            groups.append([token])
        else:
            groups[-1].append(token)
    return groups


def _layered(base: Sequence[str], top: Sequence[str]) -> tuple[str, ...]:
    """`base` overrides (the eval fleet's `--eval-sglang-*`) under `top` (the YAML group's): a flag of `top`
    replaces the one of `base`; `--no-X` of `top` is kept, so it still drops an inherited `--sglang-X` later
    (`spec.override_args`)."""
    names = {group[0] for group in argv_groups(top)}
    names |= {"--" + name[len("--no-"):] for name in names if name.startswith("--no-")}
    kept = [group for group in argv_groups(base) if group[0] not in names]
    return tuple(token for group in kept + argv_groups(top) for token in group)


def _model_path(entry: ModelEntry, source: str) -> str | None:
    paths = {group[4] for group in entry.groups if group[4] is not None}
    if entry.model_path is not None:
        paths.add(entry.model_path)
    if len(paths) > 1:
        raise _fail(source, entry.where, f"server groups with different model_path values {sorted(paths)}: all "
                    "groups of a model serve one model_path (as miles requires)")
    path = paths.pop() if paths else None
    # slime/miles: every group without an overrides.model_path gets the model's (or --hf-checkpoint)
    if path is not None and any(group[4] is None for group in entry.groups) and entry.model_path is None:
        raise _fail(source, entry.where, "some server groups set overrides.model_path and others do not (they "
                    "would serve --hf-checkpoint): give the model's model_path instead")
    return path


def deployment(config: RunConfig) -> Deployment | None:
    """`--sglang-config` mapped onto this run's engine groups; None without the flag. Raises ConfigError naming
    the file and the key for what rayless cannot serve."""
    path = config.sglang.sglang_config
    if path is None:
        return None
    source = f"{FLAG} {path}"
    cluster = config.cluster
    hf_checkpoint = str(config.rollout.hf_checkpoint) if config.rollout.hf_checkpoint is not None else None
    policy: list[ModelEntry] = []
    evaluation: ModelEntry | None = None
    for entry in models_of(path):
        if entry.name == "eval":
            evaluation = entry
        else:
            policy.append(entry)
    if len(policy) != 1:
        if not policy:
            raise _fail(source, "sglang", "no policy model: one entry besides `eval` is the rollout engines")
        raise _fail(source, f"{policy[1].where} (name {policy[1].name!r})", "a second model served beside the "
                    "policy (a frozen reference, reward or tool model): rayless launches one policy model (and "
                    "the eval fleet, `name: eval`); serve other models yourself and point your hooks at them")
    actor = policy[0]
    model_path = _model_path(actor, source)
    if actor.update_weights is False:
        raise _fail(source, f"{actor.where}.update_weights", "false: rollouts from a frozen model; rayless' rollout "
                    "engines always receive the trained weights")
    if model_path is not None and hf_checkpoint is not None and Path(model_path) != Path(hf_checkpoint) \
            and actor.update_weights is not True:
        raise _fail(source, f"{actor.where}.model_path", f"{model_path} differs from --hf-checkpoint, which makes it "
                    "a frozen model in slime/miles (update_weights defaults to false): set `update_weights: true` "
                    "to serve it and update it with the trained weights")
    on_cpu = cluster.rollout_num_engines is not None
    size_flag = "--rollout-num-engines" if on_cpu else "--rollout-num-gpus"
    nodes = cluster.actor_num_nodes
    rollout = _resolve(actor, source, default_per_engine=1 if on_cpu else cluster.rollout_num_gpus_per_engine,
                       nodes=nodes)
    total = sum(group.num_gpus for group in rollout)
    expected = cluster.rollout_num_engines if on_cpu else cluster.rollout_num_gpus
    if total != expected:
        raise _fail(source, f"{actor.where}.server_groups", f"num_gpus add up to {total}, but {size_flag} is "
                    f"{expected} (slime/miles: the groups' GPUs, placeholders included, are the rollout GPUs)")
    evals: tuple[ServerGroup, ...] = ()
    eval_cfg = config.eval
    fleet_size = eval_cfg.eval_num_engines or eval_cfg.eval_num_gpus
    if evaluation is not None:
        eval_flag = "--eval-num-engines" if eval_cfg.eval_num_engines else "--eval-num-gpus"
        if not fleet_size:
            raise _fail(source, f"{evaluation.where} (name 'eval')", "an eval model needs the eval fleet: give "
                        "--eval-num-gpus (or --eval-num-engines for CPU engines) with its GPUs")
        if evaluation.update_weights:
            raise _fail(source, f"{evaluation.where}.update_weights", "true: the eval fleet is synced by snapshot "
                        "only (miles), never by the training weight updates")
        eval_path = _model_path(evaluation, source)
        if eval_path is not None and (hf_checkpoint is None or Path(eval_path) != Path(hf_checkpoint)):
            raise _fail(source, f"{evaluation.where}.model_path", "the eval fleet serves --hf-checkpoint, then the "
                        "run's snapshots: a model_path of its own is not in rayless")
        cpu_eval = bool(eval_cfg.eval_num_engines)
        evals = _resolve(evaluation, source, default_per_engine=1 if cpu_eval else eval_cfg.eval_num_gpus_per_engine,
                         nodes=nodes, base=eval_cfg.eval_sglang_passthrough)
        eval_total = sum(group.num_gpus for group in evals)
        if eval_total != fleet_size:
            raise _fail(source, f"{evaluation.where}.server_groups", f"num_gpus add up to {eval_total}, but "
                        f"{eval_flag} is {fleet_size} (miles: exactly one model named 'eval' with that many GPUs)")
    rollout_path = model_path if model_path is not None and hf_checkpoint is not None \
        and Path(model_path) != Path(hf_checkpoint) else None
    return Deployment(source=source, rollout=rollout, eval=evals, rollout_model_path=rollout_path)


def sglang_config_maps(config: RunConfig) -> None:
    """Rule: `--sglang-config` maps onto this run, read and checked before anything launches. (SGLang's own
    `--config` cannot come from it: the `config` override is refused, and `--sglang-config` is this flag, not a
    passthrough, so an engine's command line names one `--config`, the 0600 file rayless writes.)"""
    if config.sglang.sglang_config is None:
        return
    if config.cluster.rollout_external_engine_addrs:
        raise ConfigError(f"{FLAG} {config.sglang.sglang_config} and --rollout-external-engine-addrs: the file "
                          "describes engines rayless launches; attached engines are launched by you (slime and "
                          "miles refuse both too)")
    if not config.needs_engines:
        return
    deployment(config)
