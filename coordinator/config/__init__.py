"""The run's configuration: slime/miles flag names, ten frozen slices, one frozen `Config`.

Reading a value: `config.<slice>.<flag name>` (`config.rollout.rollout_batch_size`); a derived fact:
`config.replay_mode` (cross-slice) or `config.rollout.samples_per_rollout` (one slice). Components receive
their slice. Adding a flag: one `flag(...)` line in its slice (help, type, choices, range beside it); the
parser, the `--config` file keys, `--help`, the resolved `config.json` and the range checks follow from it.

Modules: `fields` (flag declarations, the one value converter, the Slice base), one module per slice
(`cluster`, `rollout`, `sglang`, `evaluation`, `fault_tolerance`, `debug`, `training`, `checkpoint`, `logs`,
`megatron` — Megatron-LM flags of slime/miles scripts, accepted and not used, one table row per flag),
`settings` (Config, derived facts), `rules` (named cross-slice rules), `parser` (command line and files),
`unknown` (the unknown-flag report), `secrets` (masking), `porting` (slime/miles hook aliases, `--load` /
`--ref-load` on disk, the grouped notice). The start-up checks on the machine are `coordinator.checks`.
Importing this package imports neither torch nor transformers.
"""

from coordinator.config.checkpoint import CheckpointConfig
from coordinator.config.cluster import ENGINE_BACKENDS, ClusterConfig
from coordinator.config.debug import DebugConfig
from coordinator.config.evaluation import EvalConfig
from coordinator.config.fault_tolerance import FT_COMPONENTS, FaultToleranceConfig
from coordinator.config.fields import ConfigError, ConfigWarning, FlagSpec, flag
from coordinator.config.flags import FLAGS, SLICES
from coordinator.config.logs import LoggingConfig
from coordinator.config.parser import build_parser, config_from_mapping, parse_config, parse_config_mapping
from coordinator.config.rollout import DEFAULT_ROLLOUT_FUNCTION, RolloutConfig
from coordinator.config.rules import RULES
from coordinator.config.settings import Config, write_resolved_config
from coordinator.config.sglang import WEIGHT_TRANSFER_MODES, SglangConfig
from coordinator.config.training import TrainConfig

__all__ = [
    "DEFAULT_ROLLOUT_FUNCTION",
    "ENGINE_BACKENDS",
    "FLAGS",
    "FT_COMPONENTS",
    "RULES",
    "SLICES",
    "WEIGHT_TRANSFER_MODES",
    "CheckpointConfig",
    "ClusterConfig",
    "Config",
    "ConfigError",
    "ConfigWarning",
    "DebugConfig",
    "EvalConfig",
    "FaultToleranceConfig",
    "FlagSpec",
    "LoggingConfig",
    "RolloutConfig",
    "SglangConfig",
    "TrainConfig",
    "build_parser",
    "config_from_mapping",
    "flag",
    "parse_config",
    "parse_config_mapping",
    "write_resolved_config",
]
