"""How many rollouts a run makes, decided once before anything starts: `--num-rollout`, or counted.

Owns `with_rollout_count`, the one place `num_rollout` is decided: a Config whose `--num-rollout` is unset comes
back with it set — with slime's `--num-epoch`, `num_epoch × (records // rollout_batch_size)` (slime's
`get_num_rollout_per_epoch` times the epochs); replaying dumps (`--load-debug-rollout-data`), one past the
highest rollout id the template finds — so the ranks' learning-rate schedule, the loop, the status and
`config.json` all see the same count. Invariant: a config with `--num-rollout` is returned unchanged, without
reading anything; the data is read once, as the data source reads it (time and memory linear in the file).
"""

from __future__ import annotations

import dataclasses

from coordinator.config import Config, ConfigError
from coordinator.data.source import DataSourceError


def count_records(config: Config) -> int:
    from coordinator.data.tasks import open_prompt_source

    rollout = config.rollout
    source = open_prompt_source(rollout.prompt_data or "", input_key=rollout.input_key, label_key=rollout.label_key,
                                metadata_key=rollout.metadata_key, shuffle=False, seed=rollout.rollout_seed,
                                raw_prompts=True)
    return len(source)


def with_rollout_count(config: Config) -> Config:
    """`config` with `num_rollout` decided (see the module); ConfigError (exit 2) when it cannot be."""
    rollout = config.rollout
    if rollout.num_rollout is not None:
        return config
    if config.replay_mode:
        return dataclasses.replace(config, rollout=dataclasses.replace(rollout, num_rollout=_replayed(config)))
    return _with_epoch_rollouts(config)


def replayed_rollout_ids(template: str) -> list[int]:
    """The rollout ids of the dumps `--load-debug-rollout-data`'s template finds, ascending; ConfigError when it
    is not a template or finds none (the start-up check and the count both ask here)."""
    from replay.format import DumpError
    from replay.loader import ReplayLoader

    try:
        ids = ReplayLoader(template).available_rollout_ids()
    except DumpError as error:
        raise ConfigError(f"--load-debug-rollout-data {template!r}: {error}") from None
    if not ids:
        raise ConfigError(f"--load-debug-rollout-data {template!r} matches no dump file (the dumps' template, "
                          "e.g. 'dumps/{rollout_id}.rld' as --save-debug-rollout-data wrote them)")
    return ids


def _replayed(config: Config) -> int:
    """Replay without --num-rollout: every dump the template finds."""
    return max(replayed_rollout_ids(config.debug.load_debug_rollout_data or "")) + 1


def _with_epoch_rollouts(config: Config) -> Config:
    epochs, rollout = config.sft.num_epoch, config.rollout
    if epochs is None:
        return config
    try:
        records = count_records(config)
    except DataSourceError as error:
        raise ConfigError(f"--num-epoch {epochs} counts the records of --prompt-data: {error}") from None
    per_epoch = records // (rollout.rollout_batch_size or 1)
    if per_epoch == 0:
        raise ConfigError(f"--num-epoch {epochs}: --prompt-data holds {records} records, fewer than one "
                          f"--rollout-batch-size {rollout.rollout_batch_size}, so an epoch has no rollout")
    return dataclasses.replace(config, rollout=dataclasses.replace(rollout, num_rollout=epochs * per_epoch))
