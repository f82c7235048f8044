"""slime's `--num-epoch`: the number of rollouts, counted from the data before anything starts.

Owns `with_epoch_rollouts`: a Config whose `--num-rollout` is unset but whose `--num-epoch` is given comes back
with `num_rollout = num_epoch × (records // rollout_batch_size)` (slime's `get_num_rollout_per_epoch` times
the epochs), so the ranks' learning-rate schedule, the loop and `config.json` all see the same count. Invariant: a
config with `--num-rollout` (or without `--num-epoch`) is returned unchanged, without reading any data; the data
is read once, as the data source reads it (time and memory linear in the file).
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


def with_epoch_rollouts(config: Config) -> Config:
    epochs, rollout = config.sft.num_epoch, config.rollout
    if epochs is None or rollout.num_rollout is not None or config.replay_mode:
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
