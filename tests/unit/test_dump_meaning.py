"""What `rayless dump verify` checks beyond form (`replay.meaning`), and `.pt` imports of any plain structure.

Properties: a sample that means something has no problem; one fault of meaning put into it is exactly one
problem naming the field; any plain structure pickled as a slime dump, sets and OrderedDicts included,
converts or is one DumpError (never another exception); pickles that build an allowed global from bad
arguments are one DumpError naming the file.
"""

from __future__ import annotations

import dataclasses
import pickle  # noqa: TID251 - writes hostile test inputs; rayless never unpickles with it
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from replay.format import DumpError, write_dump
from replay.loader import ReplayLoader
from replay.meaning import INT32_MAX, MeaningCheck, sample_problems
from replay.sample import Sample, SampleStatus
from replay.torch_import import convert_torch_dump
from tests.support.hostile_dumps import BAD_BUILDS, torch_zip


@st.composite
def sound_samples(draw: st.DrawFn) -> Sample:
    response = draw(st.integers(0, 6))
    tokens = draw(st.lists(st.integers(0, 999), min_size=response + 1, max_size=response + 5))
    reward = draw(st.one_of(st.none(), st.floats(-10, 10), st.dictionaries(st.text(max_size=4), st.floats(-1, 1),
                                                                            max_size=2)))
    return Sample(group_index=draw(st.integers(0, 50)), sample_index=draw(st.integers(0, 15)), prompt="p",
                  tokens=tokens, response_length=response,
                  loss_mask=draw(st.lists(st.sampled_from([0, 1]), min_size=response, max_size=response)),
                  rollout_log_probs=draw(st.lists(st.floats(-50, 0), min_size=response, max_size=response)),
                  reward=reward, status=draw(st.sampled_from(list(SampleStatus))),
                  advantage=draw(st.floats(-5, 5)), index=draw(st.one_of(st.none(), st.integers(0, 10**6))))


def _with_logprob(sample: Sample, value: float) -> Sample:
    if not sample.response_length:
        sample = dataclasses.replace(sample, tokens=[*sample.tokens, 1], response_length=1, loss_mask=[1],
                                     rollout_log_probs=[-1.0])
    return dataclasses.replace(sample, rollout_log_probs=[value, *sample.rollout_log_probs[1:]])


def _with_mask(sample: Sample, value: int) -> Sample:
    sample = _with_logprob(sample, -1.0)
    return dataclasses.replace(sample, loss_mask=[value, *sample.loss_mask[1:]])


FAULTS = {
    "reward": lambda s: dataclasses.replace(s, reward=float("nan")),
    "reward[": lambda s: dataclasses.replace(s, reward={"score": float("inf")}),
    "group_index": lambda s: dataclasses.replace(s, group_index=-1),
    "sample_index": lambda s: dataclasses.replace(s, sample_index=-3),
    "index": lambda s: dataclasses.replace(s, index=-1),
    "token id": lambda s: dataclasses.replace(s, tokens=[10**15, *s.tokens[1:]]),
    "advantage": lambda s: dataclasses.replace(s, advantage=float("-inf")),
    "rollout logprob": lambda s: _with_logprob(s, float("nan")),
    "is above 0": lambda s: _with_logprob(s, 0.5),
    "loss_mask": lambda s: _with_mask(s, 2),
}


@settings(max_examples=100, deadline=None, database=None)
@given(sample=sound_samples(), fault=st.sampled_from(sorted(FAULTS)))
def test_a_sound_sample_has_no_problem_and_one_fault_is_one_problem_naming_its_field(sample: Sample,
                                                                                    fault: str) -> None:
    assert sample_problems(sample) == []
    problems = sample_problems(FAULTS[fault](sample))
    assert len(problems) == 1 and fault in problems[0], problems


@settings(max_examples=50, deadline=None, database=None)
@given(samples=st.lists(sound_samples(), max_size=8), vocab=st.integers(1, 1200))
def test_the_dump_check_counts_repeats_and_out_of_vocabulary_ids(samples: list[Sample], vocab: int) -> None:
    check = MeaningCheck(vocab_size=vocab)
    for sample in samples:
        check.add(sample)
    positions = [(s.group_index, s.sample_index) for s in samples]
    indices = [s.index for s in samples if s.index is not None]
    expected = (len(positions) - len(set(positions)) + len(indices) - len(set(indices))
                + sum(1 for s in samples if s.tokens and max(s.tokens) >= vocab))
    assert check.problems == expected
    assert (check.summary() is None) == (expected == 0)


def test_token_ids_beyond_int32_are_named_even_without_a_vocabulary() -> None:
    sample = Sample(tokens=[1, INT32_MAX + 1], response_length=0, status=SampleStatus.COMPLETED)
    assert sample_problems(sample) == [f"token id {INT32_MAX + 1} does not fit int32 (engines and the trainer "
                                       "hold ids as int32)"]
    assert sample_problems(dataclasses.replace(sample, tokens=[1, INT32_MAX])) == []


HASHABLE = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=5), st.binary(max_size=4),
                     st.frozensets(st.integers(), max_size=2))
VALUES = st.recursive(
    st.one_of(HASHABLE, st.integers(min_value=2**63), st.just(float("nan"))),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(HASHABLE, inner, max_size=3),
                            st.dictionaries(HASHABLE, inner, max_size=3).map(OrderedDict),
                            st.sets(HASHABLE, max_size=3), st.tuples(inner, inner)),
    max_leaves=10)
FIELDS = ["tokens", "response_length", "reward", "group_index", "index", "rollout_log_probs", "loss_mask", "status",
          "prompt", "response", "label", "metadata", "weight_versions", "advantage", "sample_index"]
BASE = {"tokens": [1, 2, 3], "response_length": 2, "reward": 1.0, "group_index": 0, "index": 0,
        "rollout_log_probs": [-0.1, -0.2], "loss_mask": [1, 1], "status": "completed"}
SAMPLES = st.builds(lambda extra, start: {**(BASE if start else {}), **extra},
                    st.dictionaries(st.one_of(st.sampled_from(FIELDS), HASHABLE), VALUES, max_size=4), st.booleans())
DUMPS = st.one_of(VALUES, st.builds(lambda s, rid, md: {"rollout_id": rid, "samples": s, "metadata": md},
                                    st.lists(SAMPLES, max_size=3), st.one_of(st.integers(), VALUES), VALUES))


@settings(max_examples=150, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(dump=DUMPS, n=st.one_of(st.none(), st.integers(-1, 3)))
def test_any_plain_structure_converts_or_is_one_dump_error(tmp_path: Path, dump: Any, n: int | None) -> None:
    src = tmp_path / "x.pt"
    src.write_bytes(pickle.dumps(dump, protocol=4))
    try:
        convert_torch_dump(src, tmp_path / "x.rld", n_samples_per_prompt=n, allow_missing_logprobs=True)
    except DumpError:
        pass


@pytest.mark.parametrize("name", sorted(BAD_BUILDS))
@pytest.mark.parametrize("container", ["zip", "bare"])
def test_a_pickle_building_an_allowed_global_badly_is_one_dump_error(tmp_path: Path, name: str,
                                                                    container: str) -> None:
    src = tmp_path / "bad.pt"
    if container == "zip":
        torch_zip(src, BAD_BUILDS[name])
    else:
        src.write_bytes(BAD_BUILDS[name])
    with pytest.raises(DumpError) as error:
        convert_torch_dump(src, tmp_path / "out.rld")
    assert str(error.value).startswith(f"{src}: ") and "\n" not in str(error.value)
    assert not (tmp_path / "out.rld").exists()


def test_a_torch_zip_of_plain_data_still_converts(tmp_path: Path) -> None:
    sample = {**BASE, "metadata": OrderedDict(a=[1, 2]), "label": "x"}
    src = torch_zip(tmp_path / "ok.pt", pickle.dumps({"rollout_id": 3, "samples": [sample]}, protocol=2))
    out = convert_torch_dump(src, tmp_path / "ok.rld")
    assert out.is_file()
    with open(out, "rb") as handle:
        assert handle.read(8) == b"\x89RLDUMP\n"


@pytest.mark.parametrize(("change", "reason"), [
    ({"reward": float("nan")}, "reward nan is not a finite number"),
    ({"group_index": -2}, "group_index -2 is negative"),
    ({"tokens": [1, 2**40, 3]}, f"token id {2**40} does not fit int32"),
])
def test_replay_refuses_a_dump_whose_samples_mean_nothing_naming_the_file(tmp_path: Path, change: dict[str, Any],
                                                                         reason: str) -> None:
    template = str(tmp_path / "{rollout_id}.rld")
    good = Sample(tokens=[1, 2, 3], response_length=1, loss_mask=[1], rollout_log_probs=[-0.5], reward=1.0,
                  status=SampleStatus.COMPLETED)
    samples = [good, dataclasses.replace(good, sample_index=1, **change)]
    path = write_dump(tmp_path / "0.rld", 0, samples, config_facts={})
    with pytest.raises(DumpError, match=f"^{path}: sample #1 \\(.*\\): {reason}"):
        ReplayLoader(template).load_rollout(0)
    # repeats are harmless to training: a dump giving one sample_index twice still replays
    write_dump(tmp_path / "0.rld", 0, [good, good], config_facts={})
    assert len(ReplayLoader(template).load_rollout(0).samples) == 2
