"""The run's configuration: one argparse parser with slime/miles flag names, one frozen `Config`.

Owns every flag, its default and its validation, and every *derived* fact (replay mode, which fault-tolerance
components are on, how many engines exist, the generate concurrency). No other module re-derives these: they
read the properties here.

Invariants:
- Defaults live only on the `Config` dataclass fields; the parser supplies what the user typed (argparse
  `SUPPRESS`), so a `--config FILE` value, a command-line value and a default can be told apart and the command
  line always wins.
- `validate()` runs before anything is launched: a contradiction raises `ConfigError` naming the flags, and the
  CLI turns it into exit status 2.
- Importing this module imports neither torch nor transformers.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

FT_COMPONENTS = ("rollout", "train")
ADVANTAGE_ESTIMATORS = ("grpo", "reinforce_plus_plus_baseline")
RM_TYPES = ("exact_match", "math", "first_digit", "char_match")
WEIGHT_TRANSFER_MODES = ("disk", "distributed")
ENGINE_BACKENDS = ("auto", "cpu", "sglang")
DEFAULT_ROLLOUT_FUNCTION = "coordinator.rollout.generate:DefaultRollout"


class ConfigError(ValueError):
    """Flags that contradict each other or are incomplete. The message names the flags."""


class ConfigWarning(UserWarning):
    """A flag that has no effect in this configuration (as miles warns, rather than fails)."""


@dataclass(frozen=True)
class Config:
    # --- model / data -------------------------------------------------------------------------------------
    hf_checkpoint: str | None = None
    prompt_data: str | None = None
    input_key: str = "prompt"
    label_key: str | None = None
    metadata_key: str | None = None
    apply_chat_template: bool = False
    # --- rollout ------------------------------------------------------------------------------------------
    rollout_batch_size: int | None = None
    n_samples_per_prompt: int = 1
    over_sampling_batch_size: int | None = None
    global_batch_size: int | None = None
    num_rollout: int | None = None
    rollout_max_response_len: int = 1024
    rollout_max_context_len: int | None = None
    rollout_temperature: float = 1.0
    rollout_top_p: float = 1.0
    rollout_top_k: int = -1
    rollout_stop: tuple[str, ...] = ()
    rollout_stop_token_ids: tuple[int, ...] = ()
    rollout_seed: int = 42
    rollout_shuffle: bool = False
    rollout_function_path: str = DEFAULT_ROLLOUT_FUNCTION
    eval_function_path: str | None = None
    custom_rm_path: str | None = None
    rm_type: str | None = None
    reward_key: str | None = None
    group_rm: bool = False
    advantage_estimator: str = "grpo"
    disable_grpo_std_normalization: bool = False
    dynamic_sampling_filter_path: str | None = None
    partial_rollout: bool = False
    async_rollout: bool = False
    max_weight_staleness: int = 1
    # --- cluster ------------------------------------------------------------------------------------------
    actor_num_nodes: int = 1
    actor_num_gpus_per_node: int = 1
    actor_node_rank: int = 0
    rdzv_endpoint: str | None = None
    rollout_num_gpus: int | None = None
    rollout_num_gpus_per_engine: int = 1
    rollout_num_engines: int | None = None
    rollout_external_engine_addrs: tuple[str, ...] = ()
    engine_backend: str = "auto"
    control_host: str = "127.0.0.1"
    control_port: int = 0
    # --- sglang -------------------------------------------------------------------------------------------
    sglang_server_concurrency: int = 512
    use_sglang_router: bool = False
    sglang_router_policy: str = "cache_aware"
    sglang_api_key: str | None = None
    sglang_context_length: int | None = None
    sglang_passthrough: tuple[str, ...] = ()
    update_weight_transfer_mode: str = "disk"
    # --- eval ---------------------------------------------------------------------------------------------
    eval_num_gpus: int = 0
    eval_num_engines: int = 0
    eval_interval: int | None = None
    eval_prompt_data: tuple[str, ...] = ()
    n_samples_per_eval_prompt: int = 1
    eval_temperature: float | None = None
    eval_top_p: float | None = None
    eval_max_response_len: int | None = None
    eval_max_in_flight: int = 1
    # --- fault tolerance ----------------------------------------------------------------------------------
    use_fault_tolerance: bool = False
    ft_components: frozenset[str] = frozenset({"rollout"})
    ft_components_given: bool = False
    rollout_health_check_interval: float = 30.0
    rollout_health_check_timeout: float = 30.0
    rollout_health_check_first_wait: float = 0.0
    rollout_health_check_failure_threshold: int = 2
    max_restarts: int = 3
    inject_engine_fault_at_rollout: int | None = None
    # --- debug --------------------------------------------------------------------------------------------
    save_debug_rollout_data: str | None = None
    load_debug_rollout_data: str | None = None
    load_debug_rollout_data_subsample: float | None = None
    debug_train_only: bool = False
    debug_rollout_only: bool = False
    ci_test: bool = False
    # --- training -----------------------------------------------------------------------------------------
    seed: int = 1234
    lr: float = 1e-6
    lr_warmup_iters: int = 0
    weight_decay: float = 0.0
    clip_grad: float = 1.0
    eps_clip: float = 0.2
    eps_clip_high: float | None = None
    kl_coef: float = 0.0
    use_kl_loss: bool = False
    entropy_coef: float = 0.0
    max_tokens_per_gpu: int = 8192
    # --- checkpoint ---------------------------------------------------------------------------------------
    save: str | None = None
    load: str | None = None
    save_interval: int | None = None
    keep_weight_snapshots: int = 2
    # --- logging ------------------------------------------------------------------------------------------
    run_dir: str | None = None
    use_tensorboard: bool = False
    use_wandb: bool = False
    no_progress: bool = False
    log_level: str = "INFO"
    config_file: str | None = field(default=None, metadata={"flag": "--config"})

    # ------------------------------------------------------------------------------------------------------
    # Derived facts: the only place they are computed.
    # ------------------------------------------------------------------------------------------------------
    @property
    def replay_mode(self) -> bool:
        """Rollouts come from dumps; nothing that generates is built."""
        return self.load_debug_rollout_data is not None

    @property
    def train_only(self) -> bool:
        """No engines: replay mode forces it, `--debug-train-only` asks for it."""
        return self.debug_train_only or self.replay_mode

    @property
    def builds_rollout_fn(self) -> bool:
        """The rollout fn is built unless replay supplies the data (it may be an SFT-style producer)."""
        return not self.replay_mode

    @property
    def needs_engines(self) -> bool:
        return not self.train_only

    @property
    def needs_train_ranks(self) -> bool:
        return not self.debug_rollout_only

    @property
    def rollout_ft_enabled(self) -> bool:
        return self.use_fault_tolerance and "rollout" in self.ft_components

    @property
    def train_ft_enabled(self) -> bool:
        return self.use_fault_tolerance and "train" in self.ft_components

    @property
    def health_monitor_enabled(self) -> bool:
        """Monitors watch rollout engines only when rollout FT is on and engines exist."""
        return self.rollout_ft_enabled and self.needs_engines

    @property
    def fault_injection_rollout(self) -> int | None:
        """The rollout at which one engine is killed: --inject-engine-fault-at-rollout, or 1 with --ci-test."""
        if self.inject_engine_fault_at_rollout is not None:
            return self.inject_engine_fault_at_rollout
        return 1 if self.ci_test else None

    @property
    def fault_injection_armed(self) -> bool:
        return self.fault_injection_rollout is not None and self.health_monitor_enabled

    @property
    def num_launched_rollout_engines(self) -> int:
        if not self.needs_engines:
            return 0
        if self.rollout_num_engines is not None:
            return self.rollout_num_engines
        if self.rollout_num_gpus is not None:
            return self.rollout_num_gpus // self.rollout_num_gpus_per_engine
        return 0

    @property
    def num_rollout_engines(self) -> int:
        """Launched plus attached rollout engines; 0 in train-only modes."""
        if not self.needs_engines:
            return 0
        return self.num_launched_rollout_engines + len(self.rollout_external_engine_addrs)

    @property
    def generate_concurrency(self) -> int:
        """Requests in flight across the rollout engines. Only meaningful when engines exist."""
        if self.num_rollout_engines == 0:
            raise ConfigError(
                "generate concurrency asked for in a run without rollout engines "
                "(--load-debug-rollout-data / --debug-train-only, or no --rollout-num-engines)"
            )
        return self.sglang_server_concurrency * self.num_rollout_engines

    @property
    def num_eval_engines(self) -> int:
        if not self.needs_engines:
            return 0
        if self.eval_num_engines:
            return self.eval_num_engines
        return self.eval_num_gpus // self.rollout_num_gpus_per_engine

    @property
    def eval_fleet_enabled(self) -> bool:
        return self.num_eval_engines > 0

    @property
    def eval_datasets(self) -> list[tuple[str, str]]:
        items = list(self.eval_prompt_data)
        return [(items[i], items[i + 1]) for i in range(0, len(items) - 1, 2)]

    @property
    def num_train_ranks(self) -> int:
        return self.actor_num_nodes * self.actor_num_gpus_per_node if self.needs_train_ranks else 0

    @property
    def effective_over_sampling_batch_size(self) -> int:
        return self.over_sampling_batch_size or self.rollout_batch_size or 0

    @property
    def samples_per_rollout(self) -> int:
        return (self.rollout_batch_size or 0) * self.n_samples_per_prompt

    @property
    def effective_global_batch_size(self) -> int:
        return self.global_batch_size or self.samples_per_rollout

    @property
    def train_steps_per_rollout(self) -> int:
        return self.samples_per_rollout // self.effective_global_batch_size

    @property
    def effective_eval_function_path(self) -> str:
        return self.eval_function_path or self.rollout_function_path

    @property
    def shares_rollout_and_eval_fn(self) -> bool:
        return self.effective_eval_function_path == self.rollout_function_path

    @property
    def resolved_run_dir(self) -> Path:
        return Path(self.run_dir) if self.run_dir else Path("runs") / "latest"

    def resolved_engine_backend(self, *, cuda_available: bool) -> str:
        if self.engine_backend != "auto":
            return self.engine_backend
        return "sglang" if cuda_available else "cpu"

    # ------------------------------------------------------------------------------------------------------
    def validate(self) -> None:
        """Raise `ConfigError` on the first contradiction, naming the flags; warn on flags with no effect."""
        for name in ("rollout_batch_size", "global_batch_size", "over_sampling_batch_size", "num_rollout"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ConfigError(f"{_flag(name)} must be positive, got {value}")
        for name in ("n_samples_per_prompt", "sglang_server_concurrency", "actor_num_nodes",
                     "actor_num_gpus_per_node", "rollout_num_gpus_per_engine", "rollout_max_response_len",
                     "max_tokens_per_gpu", "n_samples_per_eval_prompt", "eval_max_in_flight"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{_flag(name)} must be positive, got {getattr(self, name)}")
        if self.hf_checkpoint is None:
            raise ConfigError("--hf-checkpoint is required (a local Hugging Face model directory)")

        if self.debug_train_only and self.debug_rollout_only:
            raise ConfigError("--debug-train-only and --debug-rollout-only contradict: each disables the other half")
        if self.replay_mode:
            if self.debug_rollout_only:
                raise ConfigError(
                    "--load-debug-rollout-data replays dumps into training; --debug-rollout-only disables "
                    "training: choose one"
                )
            if self.eval_num_engines or self.eval_num_gpus:
                raise ConfigError(
                    "--load-debug-rollout-data starts no engines, so --eval-num-engines/--eval-num-gpus "
                    "(an eval fleet) cannot run: drop one"
                )
            if "{rollout_id}" not in self.load_debug_rollout_data:  # type: ignore[operator]
                raise ConfigError(
                    f"--load-debug-rollout-data {self.load_debug_rollout_data!r} must contain '{{rollout_id}}', "
                    "e.g. 'dumps/{rollout_id}.rld'"
                )
            if self.async_rollout:
                raise ConfigError("--async-rollout overlaps generation with training; "
                                  "--load-debug-rollout-data generates nothing: drop one")
            if self.rollout_external_engine_addrs or self.rollout_num_engines or self.rollout_num_gpus:
                warnings.warn(
                    "--load-debug-rollout-data starts no engines: --rollout-num-engines / --rollout-num-gpus / "
                    "--rollout-external-engine-addrs are ignored",
                    ConfigWarning,
                    stacklevel=2,
                )
        elif self.load_debug_rollout_data_subsample is not None:
            raise ConfigError("--load-debug-rollout-data-subsample needs --load-debug-rollout-data")
        if self.load_debug_rollout_data_subsample is not None and not 0 < self.load_debug_rollout_data_subsample <= 1:
            raise ConfigError(
                f"--load-debug-rollout-data-subsample must be in (0, 1], got {self.load_debug_rollout_data_subsample}"
            )
        if self.save_debug_rollout_data is not None and "{rollout_id}" not in self.save_debug_rollout_data:
            raise ConfigError(
                f"--save-debug-rollout-data {self.save_debug_rollout_data!r} must contain '{{rollout_id}}'"
            )

        if self.rollout_num_gpus is not None and self.rollout_num_gpus % self.rollout_num_gpus_per_engine:
            raise ConfigError(
                f"--rollout-num-gpus {self.rollout_num_gpus} is not divisible by "
                f"--rollout-num-gpus-per-engine {self.rollout_num_gpus_per_engine}"
            )
        if self.rollout_num_engines is not None and self.rollout_num_gpus is not None:
            raise ConfigError("--rollout-num-engines (CPU engines) and --rollout-num-gpus both size the rollout "
                              "fleet: give one")
        if self.eval_num_engines and self.eval_num_gpus:
            raise ConfigError("--eval-num-engines and --eval-num-gpus both size the eval fleet: give one")
        if self.eval_num_gpus % self.rollout_num_gpus_per_engine:
            raise ConfigError(
                f"--eval-num-gpus {self.eval_num_gpus} is not divisible by "
                f"--rollout-num-gpus-per-engine {self.rollout_num_gpus_per_engine}"
            )

        unknown = set(self.ft_components) - set(FT_COMPONENTS)
        if unknown:
            raise ConfigError(
                f"--ft-components: unknown component(s) {sorted(unknown)}; choose from {list(FT_COMPONENTS)}"
            )
        if self.ft_components_given and not self.use_fault_tolerance:
            warnings.warn(
                "--ft-components has no effect without --use-fault-tolerance", ConfigWarning, stacklevel=2
            )
        if self.inject_engine_fault_at_rollout is not None and not self.health_monitor_enabled:
            warnings.warn(
                "--inject-engine-fault-at-rollout is armed only with rollout fault tolerance "
                "(--use-fault-tolerance --ft-components rollout) and rollout engines; it is ignored",
                ConfigWarning,
                stacklevel=2,
            )

        if self.needs_engines and self.num_rollout_engines == 0:
            raise ConfigError(
                "this run generates rollouts but has no rollout engines: give --rollout-num-engines (CPU), "
                "--rollout-num-gpus or --rollout-external-engine-addrs, or use --debug-train-only / "
                "--load-debug-rollout-data"
            )
        if self.use_sglang_router and not self.needs_engines:
            raise ConfigError("--use-sglang-router needs rollout engines, which this run does not start")
        if self.num_rollout is None and not self.replay_mode:
            raise ConfigError("--num-rollout is required (how many rollouts to run)")

        if not self.replay_mode:
            if self.rollout_batch_size is None:
                raise ConfigError("--rollout-batch-size is required (prompt groups per rollout)")
            if self.rollout_function_path == DEFAULT_ROLLOUT_FUNCTION and self.prompt_data is None:
                raise ConfigError("--prompt-data is required by the default rollout function "
                                  "(a JSONL/Parquet file, or builtin:first_digit)")
            if self.effective_over_sampling_batch_size < self.rollout_batch_size:
                raise ConfigError(
                    f"--over-sampling-batch-size {self.over_sampling_batch_size} is smaller than "
                    f"--rollout-batch-size {self.rollout_batch_size}"
                )
            if self.global_batch_size is not None and self.samples_per_rollout % self.global_batch_size:
                raise ConfigError(
                    f"--global-batch-size {self.global_batch_size} does not divide --rollout-batch-size × "
                    f"--n-samples-per-prompt = {self.rollout_batch_size} × {self.n_samples_per_prompt} = "
                    f"{self.samples_per_rollout}"
                )
            if self.needs_train_ranks and self.effective_global_batch_size % self.num_train_ranks:
                raise ConfigError(
                    f"--global-batch-size {self.effective_global_batch_size} is not divisible by the "
                    f"{self.num_train_ranks} training ranks (--actor-num-nodes × --actor-num-gpus-per-node)"
                )
        if self.rollout_temperature < 0:
            raise ConfigError(f"--rollout-temperature must be ≥ 0, got {self.rollout_temperature}")
        if not 0 < self.rollout_top_p <= 1:
            raise ConfigError(f"--rollout-top-p must be in (0, 1], got {self.rollout_top_p}")
        if self.advantage_estimator not in ADVANTAGE_ESTIMATORS:
            raise ConfigError(
                f"--advantage-estimator {self.advantage_estimator!r}: choose from {list(ADVANTAGE_ESTIMATORS)}"
            )
        if self.rm_type is not None and self.custom_rm_path is not None:
            raise ConfigError("--rm-type and --custom-rm-path both choose the reward: give one")
        if self.group_rm and self.custom_rm_path is None:
            raise ConfigError("--group-rm applies to --custom-rm-path, which is not set")
        if len(self.eval_prompt_data) % 2:
            raise ConfigError("--eval-prompt-data takes pairs: NAME PATH [NAME PATH ...]")
        if self.eval_interval is not None and self.eval_interval <= 0:
            raise ConfigError(f"--eval-interval must be positive, got {self.eval_interval}")
        if self.eval_fleet_enabled and (self.eval_interval is None or not self.eval_prompt_data):
            raise ConfigError("an eval fleet (--eval-num-engines/--eval-num-gpus) needs --eval-interval and "
                              "--eval-prompt-data")
        if self.save_interval is not None and self.save is None:
            raise ConfigError("--save-interval needs --save DIR")
        if self.max_weight_staleness < 0:
            raise ConfigError(f"--max-weight-staleness must be ≥ 0, got {self.max_weight_staleness}")
        if self.async_rollout and not self.needs_train_ranks:
            raise ConfigError("--async-rollout overlaps generation with training; --debug-rollout-only has no "
                              "training: drop one")

    def to_json(self) -> str:
        def convert(value: Any) -> Any:
            if isinstance(value, frozenset | set):
                return sorted(value)
            if isinstance(value, tuple):
                return list(value)
            return value

        data = {f.name: convert(getattr(self, f.name)) for f in dataclasses.fields(self)}
        if data.get("sglang_api_key"):
            data["sglang_api_key"] = "***"
        return json.dumps(data, indent=2, sort_keys=True)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


# ----------------------------------------------------------------------------------------------------------
# Parser
# ----------------------------------------------------------------------------------------------------------
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(Config)}


def _bool_flag(group: argparse._ArgumentGroup, name: str, help_text: str) -> None:
    group.add_argument(_flag(name), dest=name, action="store_true", default=argparse.SUPPRESS, help=help_text)


def _value_flag(group: argparse._ArgumentGroup, name: str, help_text: str, **kwargs: Any) -> None:
    default = _DEFAULTS[name]
    shown = "" if default in (None, (), frozenset()) else f" (default: {default})"
    group.add_argument(_flag(name), dest=name, default=argparse.SUPPRESS, help=help_text + shown, **kwargs)


def build_parser(prog: str = "rayless train") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Run RL post-training: rollouts on SGLang-compatible engines, training on torchrun ranks.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Unknown --sglang-* flags are passed to sglang.launch_server with the prefix removed.",
    )
    parser.add_argument("--config", dest="config_file", default=argparse.SUPPRESS,
                        help="YAML or TOML file supplying any flag (keys as flag names); the command line wins")

    g = parser.add_argument_group("cluster")
    _value_flag(g, "actor_num_nodes", "nodes of training ranks", type=int)
    _value_flag(g, "actor_num_gpus_per_node", "training ranks per node (GPUs, or gloo processes on CPU)", type=int)
    _value_flag(g, "actor_node_rank", "this node's rank for multi-node torchrun", type=int)
    _value_flag(g, "rdzv_endpoint", "torchrun rendezvous endpoint HOST:PORT for multi-node training")
    _value_flag(g, "rollout_num_gpus", "GPUs for rollout engines (SGLang)", type=int)
    _value_flag(g, "rollout_num_gpus_per_engine", "GPUs per rollout engine (tensor parallel size)", type=int)
    _value_flag(g, "rollout_num_engines", "CPU rollout engines to launch", type=int)
    _value_flag(g, "rollout_external_engine_addrs", "attach to running engines at these HOST:PORT addresses",
                nargs="+", type=str)
    _value_flag(g, "engine_backend", "engine implementation", choices=ENGINE_BACKENDS)
    _value_flag(g, "control_host", "address the control channel listens on (127.0.0.1 unless multi-node)")
    _value_flag(g, "control_port", "control channel port (0 = any free port)", type=int)

    g = parser.add_argument_group("rollout")
    _value_flag(g, "hf_checkpoint", "local Hugging Face model directory (policy, tokenizer, engines)")
    _value_flag(g, "prompt_data", "prompts: a JSONL or Parquet file, or builtin:first_digit|copy|reverse")
    _value_flag(g, "input_key", "prompt field in --prompt-data")
    _value_flag(g, "label_key", "label field in --prompt-data")
    _value_flag(g, "metadata_key", "metadata field in --prompt-data")
    _bool_flag(g, "apply_chat_template", "wrap prompts with the tokenizer's chat template")
    _value_flag(g, "rollout_batch_size", "prompt groups accepted per rollout", type=int)
    _value_flag(g, "n_samples_per_prompt", "samples generated per prompt (group size)", type=int)
    _value_flag(g, "over_sampling_batch_size", "prompt groups requested at a time while filling a rollout",
                type=int)
    _value_flag(g, "global_batch_size", "samples per optimizer step", type=int)
    _value_flag(g, "num_rollout", "rollouts to run", type=int)
    _value_flag(g, "rollout_max_response_len", "max new tokens per sample", type=int)
    _value_flag(g, "rollout_max_context_len", "prompt + response token limit (default: the engine's)", type=int)
    _value_flag(g, "rollout_temperature", "sampling temperature", type=float)
    _value_flag(g, "rollout_top_p", "nucleus sampling", type=float)
    _value_flag(g, "rollout_top_k", "top-k sampling (-1 = off)", type=int)
    _value_flag(g, "rollout_stop", "stop strings", nargs="+", type=str)
    _value_flag(g, "rollout_stop_token_ids", "stop token ids", nargs="+", type=int)
    _value_flag(g, "rollout_seed", "seed for prompt order and sampling", type=int)
    _bool_flag(g, "rollout_shuffle", "shuffle prompts every epoch")
    _value_flag(g, "rollout_function_path", "rollout fn: module.path:Name (class or function)")
    _value_flag(g, "eval_function_path", "eval fn (default: the rollout fn; the same path shares one instance)")
    _value_flag(g, "custom_rm_path", "custom reward: module.path:fn (sync or async)")
    _value_flag(g, "rm_type", "built-in reward", choices=RM_TYPES)
    _value_flag(g, "reward_key", "key of a dict reward used for advantages")
    _bool_flag(g, "group_rm", "the custom reward scores a whole group at once")
    _value_flag(g, "advantage_estimator", "advantage estimator", choices=ADVANTAGE_ESTIMATORS)
    _bool_flag(g, "disable_grpo_std_normalization", "GRPO advantages without dividing by the group std")
    _value_flag(g, "dynamic_sampling_filter_path",
                "group filter module.path:fn, e.g. coordinator.rollout.filters:reward_std_positive")
    _bool_flag(g, "partial_rollout", "keep aborted stragglers' partial tokens for the next rollout")
    _bool_flag(g, "async_rollout", "generate rollout k+1 while step k trains (one step off-policy)")
    _value_flag(g, "max_weight_staleness", "max weight versions a trained sample may lag", type=int)

    g = parser.add_argument_group("sglang")
    _value_flag(g, "sglang_server_concurrency", "requests in flight per engine", type=int)
    _bool_flag(g, "use_sglang_router", "route generate requests through sglang-router")
    _value_flag(g, "sglang_router_policy", "sglang-router policy",
                choices=("random", "round_robin", "cache_aware", "power_of_two"))
    _value_flag(g, "sglang_api_key", "API key of the engines (sent as Bearer; passed to launched engines)")
    _value_flag(g, "sglang_context_length", "engine context length", type=int)
    _value_flag(g, "update_weight_transfer_mode", "how trained weights reach the engines",
                choices=WEIGHT_TRANSFER_MODES)

    g = parser.add_argument_group("eval")
    _value_flag(g, "eval_num_gpus", "GPUs for a dedicated eval fleet", type=int)
    _value_flag(g, "eval_num_engines", "CPU engines for a dedicated eval fleet", type=int)
    _value_flag(g, "eval_interval", "evaluate every K rollouts", type=int)
    _value_flag(g, "eval_prompt_data", "NAME PATH pairs", nargs="+", type=str)
    _value_flag(g, "n_samples_per_eval_prompt", "samples per eval prompt (pass@k uses them)", type=int)
    _value_flag(g, "eval_temperature", "eval sampling temperature (default: rollout's)", type=float)
    _value_flag(g, "eval_top_p", "eval top-p (default: rollout's)", type=float)
    _value_flag(g, "eval_max_response_len", "eval max new tokens (default: rollout's)", type=int)
    _value_flag(g, "eval_max_in_flight", "evals running at once; the oldest waiting one is skipped", type=int)

    g = parser.add_argument_group("fault-tolerance")
    _bool_flag(g, "use_fault_tolerance", "enable fault tolerance for --ft-components")
    g.add_argument("--ft-components", dest="ft_components", nargs="+", default=argparse.SUPPRESS,
                   help="components to protect: rollout, train ('rollout,train' or 'rollout train'; "
                        "default: rollout)")
    _value_flag(g, "rollout_health_check_interval", "seconds between engine probes", type=float)
    _value_flag(g, "rollout_health_check_timeout", "seconds a probe may take", type=float)
    _value_flag(g, "rollout_health_check_first_wait", "grace seconds after an engine (re)starts", type=float)
    _value_flag(g, "rollout_health_check_failure_threshold", "failed probes before an engine is dead", type=int)
    _value_flag(g, "max_restarts", "torchrun restarts of dead ranks (train FT)", type=int)
    _value_flag(g, "inject_engine_fault_at_rollout", "kill one rollout engine once at this rollout (FT tests)",
                type=int)

    g = parser.add_argument_group("debug")
    _value_flag(g, "save_debug_rollout_data", "dump every rollout to this template with {rollout_id}")
    _value_flag(g, "load_debug_rollout_data", "replay dumps from this template instead of generating")
    _value_flag(g, "load_debug_rollout_data_subsample", "keep this fraction of each replayed rollout", type=float)
    _bool_flag(g, "debug_train_only", "start no engines")
    _bool_flag(g, "debug_rollout_only", "start no training ranks")
    _bool_flag(g, "ci_test", "CI mode: with rollout FT, kill one rollout engine at rollout 1 to exercise recovery")

    g = parser.add_argument_group("training")
    _value_flag(g, "seed", "training seed", type=int)
    _value_flag(g, "lr", "learning rate", type=float)
    _value_flag(g, "lr_warmup_iters", "linear warm-up steps", type=int)
    _value_flag(g, "weight_decay", "AdamW weight decay", type=float)
    _value_flag(g, "clip_grad", "gradient norm clip", type=float)
    _value_flag(g, "eps_clip", "PPO ratio clip (low)", type=float)
    _value_flag(g, "eps_clip_high", "PPO ratio clip (high; default: --eps-clip)", type=float)
    _value_flag(g, "kl_coef", "KL penalty coefficient to the reference model", type=float)
    _bool_flag(g, "use_kl_loss", "add the KL to the reference as a loss term")
    _value_flag(g, "entropy_coef", "entropy bonus coefficient", type=float)
    _value_flag(g, "max_tokens_per_gpu", "token budget of one micro-batch", type=int)

    g = parser.add_argument_group("checkpoint")
    _value_flag(g, "save", "checkpoint directory")
    _value_flag(g, "load", "resume from this checkpoint directory")
    _value_flag(g, "save_interval", "save every K rollouts", type=int)
    _value_flag(g, "keep_weight_snapshots", "weight snapshots for engines kept on disk", type=int)

    g = parser.add_argument_group("logging")
    _value_flag(g, "run_dir", "where logs, metrics and plots go (default: runs/latest)")
    _bool_flag(g, "use_tensorboard", "also write TensorBoard events (when installed)")
    _bool_flag(g, "use_wandb", "also log to wandb (when installed)")
    _bool_flag(g, "no_progress", "plain log lines instead of live progress")
    _value_flag(g, "log_level", "logging level", choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    return parser


_TUPLE_FIELDS = {
    f.name for f in dataclasses.fields(Config) if str(f.type).startswith("tuple")
}


def _load_config_file(path: str) -> dict[str, Any]:
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"--config {path}: no such file")
    text = file.read_text()
    if file.suffix == ".toml":
        try:
            import tomllib
        except ModuleNotFoundError:  # Python 3.10
            import tomli as tomllib
        data = tomllib.loads(text)
    elif file.suffix in (".yaml", ".yml"):
        import yaml

        data = yaml.safe_load(text) or {}
    else:
        raise ConfigError(f"--config {path}: expected a .yaml, .yml or .toml file")
    if not isinstance(data, dict):
        raise ConfigError(f"--config {path}: the top level must be a mapping of flag names to values")
    result: dict[str, Any] = {}
    for key, value in data.items():
        name = str(key).lstrip("-").replace("-", "_")
        if name not in _DEFAULTS or name in ("config_file", "ft_components_given", "sglang_passthrough"):
            raise ConfigError(f"--config {path}: unknown flag {key!r}")
        result[name] = value
    return result


def _split_ft_components(values: Sequence[str] | str) -> frozenset[str]:
    if isinstance(values, str):
        values = [values]
    parts = [part.strip() for value in values for part in str(value).split(",")]
    return frozenset(part for part in parts if part)


def config_from_mapping(values: dict[str, Any]) -> Config:
    """Build a Config from field names → values (what the parser and --config give), without validating."""
    values = dict(values)
    if "ft_components" in values:
        values["ft_components"] = _split_ft_components(values["ft_components"])
        values["ft_components_given"] = True
    for name in _TUPLE_FIELDS & values.keys():
        value = values[name]
        values[name] = tuple(value) if isinstance(value, list | tuple) else (value,)
    return Config(**values)


def parse_config(argv: Sequence[str] | None = None, *, prog: str = "rayless train") -> Config:
    """Parse and validate. Raises ConfigError (the CLI maps it to exit status 2)."""
    parser = build_parser(prog)
    args, unknown = parser.parse_known_args(list(sys.argv[1:] if argv is None else argv))
    passthrough, rest = _split_sglang_passthrough(unknown)
    if rest:
        raise ConfigError(f"unrecognised arguments: {' '.join(rest)}")
    given = vars(args)
    values: dict[str, Any] = {}
    if "config_file" in given:
        values.update(_load_config_file(given["config_file"]))
    values.update(given)
    if passthrough:
        values["sglang_passthrough"] = tuple(passthrough)
    config = config_from_mapping(values)
    config.validate()
    return config


def _split_sglang_passthrough(unknown: list[str]) -> tuple[list[str], list[str]]:
    """`--sglang-mem-fraction-static 0.8` → `--mem-fraction-static 0.8` for sglang.launch_server."""
    passthrough: list[str] = []
    rest: list[str] = []
    taking = False
    for token in unknown:
        if token.startswith("--sglang-"):
            passthrough.append("--" + token[len("--sglang-"):])
            taking = True
        elif token.startswith("-"):
            rest.append(token)
            taking = False
        elif taking:
            passthrough.append(token)
        else:
            rest.append(token)
    return passthrough, rest


def write_resolved_config(config: Config, run_dir: Path) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "config.json"
    path.write_text(config.to_json() + "\n")
    return path


def check_paths(config: Config) -> None:
    """File-system checks made at start-up, before any process is launched."""
    checkpoint = Path(config.hf_checkpoint or "")
    if not (checkpoint / "config.json").is_file():
        raise ConfigError(f"--hf-checkpoint {config.hf_checkpoint}: not a Hugging Face model directory "
                          "(no config.json); build one with `rayless make-tiny-model DIR`")
    if config.prompt_data and not config.prompt_data.startswith("builtin:") and not config.replay_mode:
        if not Path(config.prompt_data).is_file():
            raise ConfigError(f"--prompt-data {config.prompt_data}: no such file")
    for name, path in config.eval_datasets:
        if not path.startswith("builtin:") and not Path(path).is_file():
            raise ConfigError(f"--eval-prompt-data {name} {path}: no such file")
    if config.load and not Path(config.load).exists():
        raise ConfigError(f"--load {config.load}: no such checkpoint directory")
    from coordinator.progress import missing_metric_backends

    missing = missing_metric_backends(tensorboard=config.use_tensorboard, wandb=config.use_wandb)
    if missing:
        raise ConfigError("; ".join(missing))
