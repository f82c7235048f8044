"""A replay trains with the flags its dumps were generated with: recorded in the header, taken unless given,
each given one that differs named (coordinator/config/replayed.py)."""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path

import pytest

from coordinator.config import Config, ConfigError, parse_config
from coordinator.config.replayed import HEADER_KEY, RECORDED, ReplayFlagWarning, recorded_flags
from replay.format import dump_path, write_dump
from replay.reader import read_header
from replay.sample import Sample, SampleStatus

GENERATING = ["--hf-checkpoint", "/model", "--prompt-data", "builtin:first_digit", "--rollout-batch-size", "4",
              "--n-samples-per-prompt", "2", "--num-rollout", "12", "--rollout-num-engines", "1",
              "--lr", "3e-3", "--clip-grad", "0.5", "--eps-clip", "0.25", "--lr-decay-style", "cosine",
              "--min-lr", "1e-4", "--lr-warmup-fraction", "0.1", "--adam-beta2", "0.95", "--seed", "7",
              "--micro-batch-size", "2", "--lora-rank", "4", "--target-modules", "q_proj,v_proj"]


def sample(group: int, index: int) -> Sample:
    return Sample(group_index=group, sample_index=index, prompt="p", tokens=[1, 2, 3], response_length=1,
                  loss_mask=[1], rollout_log_probs=[-0.5], reward=1.0, status=SampleStatus.COMPLETED,
                  weight_versions=["1"])


def dump_of(config: Config, directory: Path, rollout_ids: tuple[int, ...] = (3, 4)) -> str:
    """Dumps as the rollout manager writes them (its facts carry `recorded_flags`); the template."""
    template = str(directory / "{rollout_id}.rld")
    for rollout_id in rollout_ids:
        write_dump(dump_path(template, rollout_id), rollout_id, [sample(0, 0), sample(0, 1)],
                   config_facts={"n_samples_per_prompt": 2, HEADER_KEY: recorded_flags(config)})
    return template


def replay(template: str, *flags: str) -> tuple[Config, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config = parse_config(["--load-debug-rollout-data", template, "--num-rollout", "2", *flags])
    return config, [str(w.message) for w in caught if issubclass(w.category, ReplayFlagWarning)]


def test_a_replay_given_no_training_flag_trains_as_the_generating_run(tmp_path: Path) -> None:
    generating = parse_config(GENERATING)
    template = dump_of(generating, tmp_path)
    replayed, differing = replay(template)
    assert differing == []
    assert replayed.rollout.hf_checkpoint == "/model" and replayed.train.seed == 7
    assert replayed.lora.target_modules == generating.lora.target_modules  # a tuple again, not a list
    # the ranks' step settings are the generating run's, the decay spanning its 12 steps though 2 are replayed
    assert replayed.rollout.num_rollout == 2
    for part in ("optimizer_settings", "loss_settings", "batching_settings"):
        assert (getattr(replayed.train, part)(replayed.total_train_steps)
                if part == "optimizer_settings" else getattr(replayed.train, part)()) == \
               (getattr(generating.train, part)(generating.total_train_steps)
                if part == "optimizer_settings" else getattr(generating.train, part)())
    assert replayed.train.optimizer_settings(replayed.total_train_steps).lr_decay_steps == 12
    assert recorded_flags(replayed) == recorded_flags(generating)


def test_each_given_flag_that_differs_is_named_once_and_wins(tmp_path: Path) -> None:
    template = dump_of(parse_config(GENERATING), tmp_path)
    replayed, differing = replay(template, "--lr", "1e-3", "--seed", "7", "--eps-clip", "0.3")
    assert replayed.train.lr == 1e-3 and replayed.train.eps_clip == 0.3
    assert differing == [
        f"replay: --lr 0.001 differs from the value the dumps were generated with (0.003, {tmp_path}/3.rld)",
        f"replay: --eps-clip 0.3 differs from the value the dumps were generated with (0.25, {tmp_path}/3.rld)",
    ]  # --seed 7 is the recorded value: not named


def test_a_given_flag_keeps_the_other_of_its_pair_from_the_dump(tmp_path: Path) -> None:
    # the generating run warmed up by fraction; a replay warming up by steps must not get both (a contradiction)
    template = dump_of(parse_config(GENERATING), tmp_path)
    replayed, _ = replay(template, "--lr-warmup-iters", "3")
    assert replayed.train.lr_warmup_iters == 3 and replayed.train.lr_warmup_fraction is None


def test_dumps_recording_no_flags_leave_the_defaults(tmp_path: Path) -> None:
    template = str(tmp_path / "{rollout_id}.rld")
    write_dump(dump_path(template, 0), 0, [sample(0, 0)], config_facts={"n_samples_per_prompt": 1})
    replayed, differing = replay(template, "--hf-checkpoint", "/m")
    assert replayed.train.lr == parse_config(["--hf-checkpoint", "/m", "--load-debug-rollout-data", template]).train.lr
    assert differing == []


@pytest.mark.parametrize(("flag", "value", "message"), [
    ("lr", "fast", "recorded --lr: expected a number"),
    ("clip_grad", -1.0, "recorded --clip-grad"),
    ("optimizer", "sgd9", "recorded --optimizer"),
])
def test_a_bad_recorded_value_is_refused_naming_the_file_and_flag(tmp_path: Path, flag: str, value: object,
                                                                  message: str) -> None:
    recorded = recorded_flags(parse_config(GENERATING)) | {flag: value}
    template = str(tmp_path / "{rollout_id}.rld")
    write_dump(dump_path(template, 0), 0, [sample(0, 0)], config_facts={HEADER_KEY: recorded})
    with pytest.raises(ConfigError, match=f"--load-debug-rollout-data: {tmp_path}/0.rld: {message}"):
        replay(template)


def test_the_recorded_flags_are_plain_data_a_dump_header_keeps(tmp_path: Path) -> None:
    config = parse_config(GENERATING)
    header = read_header(dump_path(dump_of(config, tmp_path, (0,)), 0))
    assert header.config[HEADER_KEY] == recorded_flags(config)
    assert set(recorded_flags(config)) == set(RECORDED)
    # what decides a step is recorded; what the machine decides is not
    assert {"lr", "clip_grad", "eps_clip", "seed", "optimizer", "micro_batch_size", "max_tokens_per_gpu",
            "use_kl_loss", "advantage_estimator", "lora_rank", "hf_checkpoint"} <= set(RECORDED)
    assert not {"train_env_vars", "actor_num_gpus_per_node", "save", "load_debug_rollout_data"} & set(RECORDED)


def test_a_replay_without_num_rollout_counts_one_past_the_highest_dump_before_anything_starts(tmp_path: Path) -> None:
    """The rollout count is decided once (`with_rollout_count`), so config.json, the plan and the loop agree."""
    from coordinator.rollout.epochs import with_rollout_count

    template = dump_of(parse_config(GENERATING), tmp_path, rollout_ids=(3, 7))
    given = parse_config(["--load-debug-rollout-data", template, "--num-rollout", "2"])
    assert with_rollout_count(given) is given  # --num-rollout given: nothing is read
    counted = with_rollout_count(parse_config(["--load-debug-rollout-data", template]))
    assert counted.rollout.num_rollout == 8
    (tmp_path / "3.rld").unlink()
    (tmp_path / "7.rld").unlink()
    with pytest.raises(ConfigError, match=r"--load-debug-rollout-data .* matches no dump file"):
        with_rollout_count(dataclasses.replace(counted, rollout=dataclasses.replace(counted.rollout, num_rollout=None)))


def test_a_replay_whose_dumps_are_not_there_stops_before_anything_launches(tmp_path: Path) -> None:
    """Given --num-rollout the count reads nothing, so the start-up check is what finds a wrong template (a run
    would otherwise launch its ranks and fail at its first rollout); a gap is said, not refused (a resumed
    replay may start past it)."""
    from coordinator.checks.preflight import check_replay

    template = dump_of(parse_config(GENERATING), tmp_path, rollout_ids=(0, 1, 3))
    assert check_replay(parse_config(["--load-debug-rollout-data", template, "--num-rollout", "2"])) == [
        f"--load-debug-rollout-data {template}: 3 dump(s), rollout ids 0..3"]
    (note,) = check_replay(parse_config(["--load-debug-rollout-data", template, "--num-rollout", "5"]))
    assert note.endswith("no dump for 2 of the 5 rollouts (the first: 2): a run replaying them stops there")
    elsewhere = str(tmp_path / "other" / "{rollout_id}.rld")
    with pytest.raises(ConfigError, match=r"--load-debug-rollout-data '.*other/\{rollout_id\}.rld' matches no dump"):
        check_replay(parse_config(["--load-debug-rollout-data", elsewhere, "--num-rollout", "2",
                                   "--hf-checkpoint", "/model"]))
