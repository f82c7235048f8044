"""`Config`: the slices composed, the facts derived across them, and the resolved config's JSON.

Owns every *cross-slice* derived fact (the slices and the flag index are `flags`'): the
mode (`replay_mode`, `train_only`, `needs_engines`, `needs_train_ranks`), the fault-tolerance gates, engine
and rank counts, the generate concurrency. Facts that read one slice only are properties of that slice
(`config.rollout.samples_per_rollout`). No other module re-derives any of them.

Invariants: a Config is frozen; `rules.validate(config)` runs each slice's checks, then each named cross-slice
rule in order, raising `ConfigError` on the first contradiction; `to_json()` never contains a secret.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from coordinator.config.aliases import apply_hook_aliases
from coordinator.config.checkpoint import CheckpointConfig, LoadPlan, resolve_load, resolve_ref_load
from coordinator.config.cluster import ClusterConfig, resolve_colocation
from coordinator.config.critic import CriticConfig
from coordinator.config.debug import DebugConfig
from coordinator.config.determinism import DeterminismConfig
from coordinator.config.distill import DistillConfig
from coordinator.config.evaluation import EvalConfig
from coordinator.config.fault_tolerance import FaultToleranceConfig
from coordinator.config.fields import ConfigError
from coordinator.config.flags import FLAGS, SLICES
from coordinator.config.hooks import HooksConfig
from coordinator.config.logs import LoggingConfig
from coordinator.config.lora import LoraConfig
from coordinator.config.megatron import MegatronConfig
from coordinator.config.rollout import RolloutConfig
from coordinator.config.secrets import MASK, mask_argv
from coordinator.config.sft import SftConfig
from coordinator.config.sglang import SglangConfig
from coordinator.config.training import TrainConfig
from coordinator.config.upstream import Row

if TYPE_CHECKING:
    from coordinator.config.sglang_file import Deployment


@dataclass(frozen=True)
class Config:
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    hooks: HooksConfig = field(default_factory=HooksConfig)
    sglang: SglangConfig = field(default_factory=SglangConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    fault_tolerance: FaultToleranceConfig = field(default_factory=FaultToleranceConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    sft: SftConfig = field(default_factory=SftConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    megatron: MegatronConfig = field(default_factory=MegatronConfig)  # type: ignore[valid-type]
    determinism: DeterminismConfig = field(default_factory=DeterminismConfig)
    #: `--config FILE`, when one supplied flags.
    config_file: str | None = None
    #: The flags the user gave (command line or file), by field name; rules use it to warn about no-ops.
    given: frozenset[str] = frozenset()
    #: slime/miles built-in hook paths replaced by ours: (flag, their path, ours); see `aliases.HOOK_ALIASES`.
    hook_aliases: tuple[tuple[str, str, str], ...] = ()
    #: `--custom-config-path` keys that name no flag: attributes of the `args` hooks get (slime's setattr).
    custom_attributes: tuple[tuple[str, Any], ...] = ()
    #: upstream flags accepted and not used (rows of `upstream_flags.tsv`), for the grouped notice.
    upstream_ignored: tuple[Row, ...] = ()
    #: sglang-router flags (`--router-*` without the prefix, with their values) for the router's command line.
    router_passthrough: tuple[str, ...] = ()
    #: old flag names upstream renamed, read as their current names: (old, new); see `upstream.RENAMED`.
    renamed_flags: tuple[tuple[str, str], ...] = ()

    # --- the mode ---------------------------------------------------------------------------------------------
    @property
    def replay_mode(self) -> bool:
        """Rollouts come from dumps; nothing that generates is built."""
        return self.debug.load_debug_rollout_data is not None

    @property
    def train_only(self) -> bool:
        """No engines: replay mode forces it, `--debug-train-only` asks for it, an SFT run needs none."""
        return self.debug.debug_train_only or self.replay_mode or self.sft.enabled

    @property
    def builds_rollout_fn(self) -> bool:
        """The rollout fn is built unless replay supplies the data (it may be an SFT-style producer)."""
        return not self.replay_mode

    @property
    def needs_engines(self) -> bool:
        return not self.train_only

    @property
    def needs_train_ranks(self) -> bool:
        return not self.debug.debug_rollout_only

    # --- fault tolerance --------------------------------------------------------------------------------------
    @property
    def ft_components(self) -> frozenset[str]:
        return self.fault_tolerance.ft_components

    @property
    def rollout_ft_enabled(self) -> bool:
        return self.fault_tolerance.use_fault_tolerance and "rollout" in self.ft_components

    @property
    def train_ft_enabled(self) -> bool:
        return self.fault_tolerance.use_fault_tolerance and "train" in self.ft_components

    @property
    def health_monitor_enabled(self) -> bool:
        """Monitors watch rollout engines only when rollout FT is on and engines exist."""
        return self.rollout_ft_enabled and self.needs_engines

    @property
    def fault_injection_rollout(self) -> int | None:
        """The rollout at which one engine is killed: --inject-engine-fault-at-rollout, or 1 with --ci-test."""
        if self.fault_tolerance.inject_engine_fault_at_rollout is not None:
            return self.fault_tolerance.inject_engine_fault_at_rollout
        return 1 if self.debug.ci_test else None

    @property
    def fault_injection_armed(self) -> bool:
        return self.fault_injection_rollout is not None and self.health_monitor_enabled

    # --- colocation ---------------------------------------------------------------------------------------------
    @property
    def colocated(self) -> bool:
        """`--colocate` in a run that both generates and trains (slime turns it off with --debug-rollout-only;
        with no engines or no ranks there is nothing to share a GPU with)."""
        return self.cluster.colocate and self.needs_engines and self.needs_train_ranks

    @property
    def offloads_train(self) -> bool:
        """The ranks' state leaves the device between steps: `--offload-train`, default on with `--colocate`;
        only in a run whose engines could use the memory (one that generates and trains)."""
        asked = self.cluster.offload_train
        return (self.colocated if asked is None else asked) and self.needs_engines and self.needs_train_ranks

    @property
    def offloads_rollout(self) -> bool:
        """The engines release their memory while the ranks train: `--offload-rollout`, default on with
        `--colocate`; only in a run that both generates and trains."""
        asked = self.cluster.offload_rollout
        return (self.colocated if asked is None else asked) and self.needs_engines and self.needs_train_ranks

    @property
    def swaps_memory(self) -> bool:
        """Each step hands memory between the engines and the ranks (`coordinator.weights.colocate`)."""
        return self.offloads_train or self.offloads_rollout

    # --- sizes ------------------------------------------------------------------------------------------------
    @property
    def num_launched_rollout_engines(self) -> int:
        cluster = self.cluster
        if not self.needs_engines:
            return 0
        if (groups := self._sglang_groups()) is not None:  # --sglang-config: its groups' engines
            return groups.engine_count("rollout")
        if cluster.rollout_num_engines is not None:
            return cluster.rollout_num_engines
        if cluster.rollout_num_gpus is not None:
            return cluster.rollout_num_gpus // cluster.rollout_num_gpus_per_engine
        return 0

    @property
    def num_rollout_engines(self) -> int:
        """Launched plus attached rollout engines; 0 in train-only modes."""
        if not self.needs_engines:
            return 0
        return self.num_launched_rollout_engines + len(self.cluster.rollout_external_engine_addrs)

    @property
    def generate_concurrency(self) -> int:
        """Requests in flight across the rollout engines. Only meaningful when engines exist."""
        if self.num_rollout_engines == 0:
            raise ConfigError(
                "generate concurrency asked for in a run without rollout engines "
                "(--load-debug-rollout-data / --debug-train-only, or no --rollout-num-engines)"
            )
        return self.sglang.sglang_server_concurrency * self.num_rollout_engines

    @property
    def num_eval_engines(self) -> int:
        if not self.needs_engines:
            return 0
        if (groups := self._sglang_groups()) is not None and groups.eval:  # --sglang-config's `eval` model
            return groups.engine_count("eval")
        if self.eval.eval_num_engines:
            return self.eval.eval_num_engines
        return self.eval.eval_num_gpus // self.eval.eval_num_gpus_per_engine

    def _sglang_groups(self) -> Deployment | None:
        """`--sglang-config` mapped onto this run (None without it): its groups size the engine fleets, as
        groups of their own engine size and placeholders make the flags' GPU counts no engine count."""
        if self.sglang.sglang_config is None or self.cluster.rollout_external_engine_addrs:
            return None
        from coordinator.config.sglang_file import deployment

        return deployment(self)

    @property
    def eval_fleet_enabled(self) -> bool:
        return self.num_eval_engines > 0

    @property
    def rollout_engine_eval_enabled(self) -> bool:
        """slime's default: with `--eval-interval` and no eval fleet, evaluate on the rollout engines."""
        return (self.needs_engines and not self.eval_fleet_enabled and self.eval.eval_interval is not None
                and bool(self.eval.dataset_specs))

    @property
    def num_train_ranks(self) -> int:
        if not self.needs_train_ranks:
            return 0
        return self.cluster.actor_num_nodes * self.cluster.actor_num_gpus_per_node

    @property
    def effective_global_batch_size(self) -> int:
        """Samples per optimizer step: --global-batch-size, else the rollout's samples / --num-steps-per-rollout
        (slime's rule), else the whole rollout (always with miles' --use-dynamic-global-batch-size)."""
        if self.train.use_dynamic_global_batch_size:
            return self.rollout.samples_per_rollout
        if self.train.global_batch_size:
            return self.train.global_batch_size
        if self.train.num_steps_per_rollout:
            return max(self.rollout.samples_per_rollout // self.train.num_steps_per_rollout, 1)
        return self.rollout.samples_per_rollout

    @property
    def total_train_steps(self) -> int | None:
        """Optimizer steps of the whole run (the default span of the learning-rate decay), when known."""
        if self.rollout.num_rollout is None or not self.rollout.samples_per_rollout:
            return None
        return self.rollout.num_rollout * self.train_steps_per_rollout

    @property
    def train_steps_per_rollout(self) -> int:
        return self.rollout.samples_per_rollout // self.effective_global_batch_size

    def load_plan(self) -> LoadPlan:
        """What `--load` holds on disk: resume from our checkpoint, or start fresh and why (reads the disk)."""
        return resolve_load(self.checkpoint, hf_checkpoint=self.rollout.hf_checkpoint)

    def reference_path(self) -> str | None:
        """The reference model's source for the ranks (None: --hf-checkpoint); checked on disk only with
        `--use-kl-loss`, as slime."""
        return resolve_ref_load(self.checkpoint, use_kl_loss=self.train.use_kl_loss)

    # --- validation and the resolved config ------------------------------------------------------------------
    def flat(self) -> dict[str, Any]:
        """Every flag's value by field name (the slime/miles flat view), secrets included."""
        return {name: getattr(getattr(self, attribute), name) for name, (attribute, _) in FLAGS.items()}

    def to_json(self) -> str:
        """The resolved config as flat flag names → values, secrets masked."""
        def plain(value: Any) -> Any:
            if isinstance(value, frozenset | set):
                return sorted(value)
            if isinstance(value, tuple):
                return list(value)
            return value

        data = {}
        for name, value in self.flat().items():
            secret = FLAGS[name][1].secret and value is not None
            data[name] = MASK if secret else plain(value)
        data["sglang_passthrough"] = mask_argv(self.sglang.sglang_passthrough)
        data["eval_sglang_passthrough"] = mask_argv(self.eval.eval_sglang_passthrough)
        data["config_file"] = self.config_file
        return json.dumps(data, indent=2, sort_keys=True)


def build_config(values: dict[str, Any], *, config_file: str | None = None, given: frozenset[str] | None = None,
                 sglang_passthrough: tuple[str, ...] = (), eval_sglang_passthrough: tuple[str, ...] = (),
                 custom_attributes: tuple[tuple[str, Any], ...] = (), upstream_ignored: tuple[Row, ...] = (),
                 router_passthrough: tuple[str, ...] = (),
                 renamed_flags: tuple[tuple[str, str], ...] = ()) -> Config:
    """A Config from converted values by field name (each routed to its slice); not validated."""
    given_names = frozenset(values) if given is None else given
    values, hook_aliases = apply_hook_aliases(values)
    values = resolve_colocation(values)
    per_slice: dict[str, dict[str, Any]] = {attribute: {} for attribute, _ in SLICES}
    for name, value in values.items():
        attribute, _ = FLAGS[name]
        per_slice[attribute][name] = value
    if sglang_passthrough:
        per_slice["sglang"]["sglang_passthrough"] = tuple(sglang_passthrough)
    if eval_sglang_passthrough:
        per_slice["eval"]["eval_sglang_passthrough"] = tuple(eval_sglang_passthrough)
    slices = {attribute: cls(**per_slice[attribute]) for attribute, cls in SLICES}
    return Config(**slices, config_file=config_file, given=given_names, hook_aliases=hook_aliases,
                  custom_attributes=custom_attributes, upstream_ignored=upstream_ignored,
                  router_passthrough=router_passthrough, renamed_flags=renamed_flags)



def write_resolved_config(config: Config, run_dir: Path) -> Path:
    """`<run_dir>/config.json`: what ran, secrets masked."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "config.json"
    path.write_text(config.to_json() + "\n")
    return path
