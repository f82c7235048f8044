"""The training flags a rollout dump records, and what a replay takes from them.

Owns `RECORDED` (the flags whose values decide a training step: the train slice — optimizer, learning-rate
schedule, loss, batching, seed — and the advantage, critic, LoRA, SFT-loss, OPD, reference and determinism flags the
ranks' settings read, plus the model), `recorded_flags(config)` (what a dump's header stores under
`train_flags`) and `replay_values(values, given)` (a replay's values: each recorded flag that neither the command
line nor a config file gives takes the dump's value; each given one that differs is named, one warning each).

Invariants: a replay that gives no training flag trains with the generating run's step settings, the
learning-rate decay spanning the generating run's steps (recorded resolved, so `--num-rollout 2` of a 60-rollout
run's dumps decays as that run did); a recorded value meets the same conversion and checks as a config file's
(a stale or hostile dump is a `ConfigError` naming the file and the flag, exit 2, before anything launches);
nothing here imports torch.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

from coordinator.config.fields import ConfigError, ConfigWarning, convert
from coordinator.config.flags import FLAGS

if TYPE_CHECKING:
    from coordinator.config.settings import Config

#: The key of a dump header's `config` that holds the recorded flags (field name → value).
HEADER_KEY = "train_flags"

_TRAIN_NOT_RECORDED = frozenset({
    "train_env_vars",      # the ranks' environment: the machine's business (and may hold tokens)
    "train_pg_timeout_s",  # a collective's deadline, not what the step computes
})
_OTHER_SLICES = (
    "hf_checkpoint", "ref_load",
    "rollout_batch_size", "n_samples_per_prompt",  # the samples per rollout: steps per rollout, decay span
    "advantage_estimator", "normalize_advantages", "disable_grpo_std_normalization", "reward_key",
    "rollout_seed",  # --load-debug-rollout-data-subsample's choice of groups
    "loss_type", "disable_compute_advantages_and_returns",
    "lora_rank", "lora_alpha", "lora_dropout", "lora_type", "target_modules", "exclude_modules",
    "lora_adapter_path",
    "use_opd", "opd_type", "opd_kl_coef", "opd_teacher_load", "opd_teacher_ckpt_step",
    "deterministic_mode",
    # PPO's critic and the discounting of per-token returns (the critic slice)
    "gamma", "lambd", "critic_lr", "critic_lr_warmup_iters", "num_critic_only_steps", "value_clip",
)
#: Every recorded flag, by field name, in the flag table's order.
RECORDED: tuple[str, ...] = tuple(
    name for name, (attribute, _) in FLAGS.items()
    if (attribute == "train" and name not in _TRAIN_NOT_RECORDED) or name in _OTHER_SLICES
)
#: Flags of which a run gives one: a recorded one is not taken when the replay gives another of its group.
_EITHER = (
    frozenset({"lr_warmup_fraction", "lr_warmup_iters"}),
    frozenset({"kl_coef", "kl_loss_coef"}),
    frozenset({"bf16", "fp16"}),
    frozenset({"global_batch_size", "num_steps_per_rollout"}),
)


class ReplayFlagWarning(ConfigWarning):
    """A training flag given to a replay that differs from the value its dumps were generated with."""


def recorded_flags(config: Config) -> dict[str, Any]:
    """The generating run's values of `RECORDED`, as plain data for a dump header. The decay span is recorded
    resolved (`--lr-decay-iters`, else the run's optimizer steps) and determinism as the ranks see it
    (`--true-on-policy-mode` implies `--deterministic-mode`)."""
    flat = config.flat()
    recorded = {name: _plain(flat[name]) for name in RECORDED}
    recorded["lr_decay_iters"] = config.train.lr_decay_iters or config.total_train_steps
    recorded["deterministic_mode"] = config.determinism.active
    return recorded


def _plain(value: Any) -> Any:
    if isinstance(value, tuple | frozenset | set):
        return sorted(value) if not isinstance(value, tuple) else list(value)
    return value


def first_dump_header(template: str) -> tuple[str, dict[str, Any]] | None:
    """(path, header config) of the lowest-numbered rollout dump `template` matches; None when it matches none."""
    from replay.format import DumpError, dump_path
    from replay.loader import ReplayLoader
    from replay.reader import read_header

    try:
        ids = ReplayLoader(template).available_rollout_ids()
    except DumpError:
        return None  # no {rollout_id}: the flag's own check says so
    if not ids:
        return None
    path = dump_path(template, ids[0])
    try:
        header = read_header(path)
    except DumpError as error:
        raise ConfigError(f"--load-debug-rollout-data: {error}") from None
    return str(path), header.config


def replay_values(values: dict[str, Any], given: frozenset[str]) -> dict[str, Any]:
    """`values` (converted, by field name) of a replay run completed from its first dump's recorded flags.

    A recorded flag the replay does not give is taken (unless the replay gives another flag of its `_EITHER`
    group); a given flag whose value differs from the recorded one is named in a `ReplayFlagWarning`, one per
    flag. Dumps that record no flags (written before they did, or converted from slime/miles) change nothing."""
    template = values.get("load_debug_rollout_data")
    if template is None:
        return values
    found = first_dump_header(template)
    if found is None:
        return values
    path, header = found
    recorded = header.get(HEADER_KEY)
    if recorded is None:
        return values
    if not isinstance(recorded, dict):
        raise ConfigError(f"--load-debug-rollout-data: {path}: the header's {HEADER_KEY} is not a mapping")
    values = dict(values)
    for name, raw in recorded.items():
        if not isinstance(name, str) or name not in RECORDED:
            continue  # a flag a later rayless records, or one this one no longer has: not ours to apply
        spec = FLAGS[name][1]
        value = convert(spec, raw, f"--load-debug-rollout-data: {path}: recorded {spec.flag}")
        if name in given:
            if values[name] != value:
                warnings.warn(f"replay: {spec.flag} {_shown(values[name])} differs from the value the dumps were "
                              f"generated with ({_shown(value)}, {path})", ReplayFlagWarning, stacklevel=2)
            continue
        if any(name in group and group & given for group in _EITHER):
            continue
        values[name] = value
    return values


def _shown(value: Any) -> str:
    if isinstance(value, tuple | list):
        return ",".join(map(str, value))
    return "unset" if value is None else str(value)
