"""The dump format: exact round trip (property test), atomic writes, and every kind of corruption refused."""

from __future__ import annotations

import math
import struct
import tempfile
import zlib
from pathlib import Path
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from replay import format as fmt
from replay.format import DumpError, dump_path, write_dump
from replay.packed_list import PackedList
from replay.reader import iter_samples, read_dump, read_header
from replay.sample import Sample, SampleStatus

INT64 = st.integers(min_value=-(2**63), max_value=2**63 - 1)
FLOATS = st.floats(allow_nan=False)
plain = st.recursive(
    st.none() | st.booleans() | INT64 | FLOATS | st.text(max_size=8) | st.binary(max_size=8),
    lambda children: (
        st.lists(children, max_size=3)
        | st.lists(children, max_size=3).map(tuple)
        | st.dictionaries(st.text(max_size=5), children, max_size=3)
    ),
    max_leaves=8,
)


@st.composite
def samples(draw: st.DrawFn) -> Sample:
    response_length = draw(st.integers(0, 12))
    prompt_tokens = draw(st.lists(INT64, max_size=12))
    return Sample(
        group_index=draw(INT64),
        sample_index=draw(INT64),
        prompt=draw(st.text(max_size=20) | plain),
        tokens=prompt_tokens + draw(st.lists(INT64, min_size=response_length, max_size=response_length)),
        response_length=response_length,
        loss_mask=draw(
            st.lists(st.integers(0, 1) | INT64, min_size=response_length, max_size=response_length)
        ),
        rollout_log_probs=draw(st.lists(FLOATS, min_size=response_length, max_size=response_length)),
        reward=draw(st.none() | FLOATS | st.dictionaries(st.text(max_size=6), FLOATS, max_size=3)),
        status=draw(st.sampled_from(list(SampleStatus))),
        weight_versions=draw(st.lists(st.text(max_size=6), max_size=3)),
        label=draw(st.none() | st.text(max_size=10) | plain),
        response=draw(st.text(max_size=20)),
        advantage=draw(FLOATS),
        metadata=draw(st.dictionaries(st.text(max_size=6), plain, max_size=4)),
        index=draw(st.none() | INT64),
    )


def typed(value: Any) -> Any:
    """A structure that differs whenever a type differs (1 == 1.0 == True would hide a lossy round trip)."""
    if isinstance(value, Sample):
        return {name: typed(getattr(value, name)) for name in fmt.SAMPLE_FIELDS}
    if isinstance(value, dict):
        return ("dict", sorted(((typed(k), typed(v)) for k, v in value.items()), key=repr))
    if isinstance(value, PackedList):  # a list that keeps the dump's bytes for the control channel
        return ("list", [typed(v) for v in value])
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, [typed(v) for v in value])
    if isinstance(value, float):
        return ("float", struct.pack("<d", value))
    return (type(value).__name__, value)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batch=st.lists(samples(), max_size=6), rollout_id=st.integers(0, 2**40))
def test_round_trip_is_exact_streaming_and_whole(batch: list[Sample], rollout_id: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = write_dump(
            dump_path(f"{tmp}/{{rollout_id}}.rld", rollout_id),
            rollout_id,
            batch,
            config_facts={"hf_checkpoint": "/m", "n_samples_per_prompt": 4},
        )
        whole = read_dump(path)
        streamed = list(iter_samples(path))
    assert whole.samples == batch
    assert [typed(s) for s in whole.samples] == [typed(s) for s in batch]
    assert [typed(s) for s in streamed] == [typed(s) for s in batch]
    assert whole.header.rollout_id == rollout_id
    assert whole.header.sample_count == len(batch)
    assert whole.header.config == {"hf_checkpoint": "/m", "n_samples_per_prompt": 4}


def make_sample(group: int = 0, index: int = 0, response_length: int = 3) -> Sample:
    return Sample(
        group_index=group,
        sample_index=index,
        prompt="2+2=",
        tokens=[5, 6, 7, 8][:1] + list(range(10, 10 + response_length)),
        response_length=response_length,
        loss_mask=[1] * response_length,
        rollout_log_probs=[-0.25] * response_length,
        reward=1.0,
        status=SampleStatus.COMPLETED,
        weight_versions=["3"],
        response="4",
    )


@pytest.fixture
def dump_file(tmp_path: Path) -> Path:
    batch = [make_sample(g, i) for g in range(2) for i in range(2)]
    return write_dump(tmp_path / "7.rld", 7, batch, config_facts={"n_samples_per_prompt": 2})


def test_special_floats_keep_their_bits(tmp_path: Path) -> None:
    nan_with_payload = struct.unpack("<d", struct.pack("<Q", 0x7FF8_0000_DEAD_BEEF))[0]
    values = [-0.0, math.inf, -math.inf, nan_with_payload, 5e-324, 1.0000000000000002]
    sample = make_sample(response_length=len(values))
    sample.rollout_log_probs = values
    sample.reward = -0.0
    path = write_dump(tmp_path / "1.rld", 1, [sample], config_facts={})
    back = read_dump(path).samples[0]
    assert [struct.pack("<d", v) for v in back.rollout_log_probs] == [struct.pack("<d", v) for v in values]
    assert struct.pack("<d", back.reward) == struct.pack("<d", -0.0)


def test_header_records_what_the_dump_is(dump_file: Path) -> None:
    header = read_header(dump_file)
    assert (header.format_version, header.rollout_id, header.kind, header.sample_count) == (
        fmt.FORMAT_VERSION,
        7,
        "rollout",
        4,
    )
    assert header.raw["sample_fields"] == list(fmt.SAMPLE_FIELDS)
    assert header.created_at > 1.6e9


def test_dump_path_templates() -> None:
    assert dump_path("d/{rollout_id}.rld", 12) == Path("d/12.rld")
    assert dump_path("d/{rollout_id}.rld", 12, eval=True) == Path("d/eval_12.rld")
    with pytest.raises(DumpError, match=r"no \{rollout_id\} placeholder"):
        dump_path("d/rollout.rld", 1)


def test_write_is_atomic_and_leaves_nothing_on_failure(tmp_path: Path) -> None:
    target = tmp_path / "3.rld"
    write_dump(target, 3, [make_sample()], config_facts={})
    before = target.read_bytes()
    bad = make_sample(index=1)
    bad.loss_mask = [1]  # contradicts response_length 3
    with pytest.raises(DumpError, match=r"3\.rld: sample #1.*loss_mask has 1 entries"):
        write_dump(target, 3, [make_sample(), bad], config_facts={})
    assert target.read_bytes() == before  # the old complete dump is untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["3.rld"]  # no temporary file left behind


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda s: setattr(s, "metadata", {"x": object()}), "cannot store a builtins.object"),
        (lambda s: setattr(s, "reward", "high"), "reward must be a float"),
        (lambda s: setattr(s, "weight_versions", [3]), "weight_versions must be a list of str"),
        (lambda s: setattr(s, "status", "completed"), "is not a SampleStatus"),
        (lambda s: setattr(s, "tokens", [1, 2**70, 3, 4]), "does not fit in 64 bits"),
    ],
)
def test_writer_refuses_what_it_could_not_read_back(tmp_path: Path, mutate: Any, message: str) -> None:
    sample = make_sample()
    mutate(sample)
    with pytest.raises(DumpError, match=message):
        write_dump(tmp_path / "1.rld", 1, [sample], config_facts={})
    assert list(tmp_path.iterdir()) == []


def read_all_ways(path: Path) -> None:
    """Both readers must refuse; returns nothing, raises the (same kind of) DumpError."""
    with pytest.raises(DumpError) as streamed:
        for _ in iter_samples(path):
            pass
    with pytest.raises(DumpError) as whole:
        read_dump(path)
    assert str(path) in str(whole.value) and str(path) in str(streamed.value)
    raise whole.value


def test_every_truncation_is_detected(dump_file: Path, tmp_path: Path) -> None:
    data = dump_file.read_bytes()
    cut = tmp_path / "cut.rld"
    for length in range(1, len(data)):
        cut.write_bytes(data[:length])
        with pytest.raises(DumpError, match=r"truncated|too short"):
            read_all_ways(cut)


def test_every_flipped_byte_is_detected(dump_file: Path, tmp_path: Path) -> None:
    data = dump_file.read_bytes()
    flipped = tmp_path / "flip.rld"
    for position in range(len(data)):
        corrupt = bytearray(data)
        corrupt[position] ^= 0x01
        flipped.write_bytes(bytes(corrupt))
        with pytest.raises(DumpError):
            read_all_ways(flipped)


def test_flipped_byte_in_a_sample_says_checksum_mismatch(dump_file: Path) -> None:
    data = bytearray(dump_file.read_bytes())
    position = data.index(b"2+2=") + 1  # inside the first sample's payload
    data[position] ^= 0x20
    dump_file.write_bytes(bytes(data))
    with pytest.raises(DumpError, match=r"7\.rld: checksum mismatch in sample #0 of 4"):
        read_all_ways(dump_file)


def test_wrong_version_and_wrong_magic(dump_file: Path) -> None:
    data = dump_file.read_bytes()
    dump_file.write_bytes(data[:8] + struct.pack("<H", 3) + data[10:])
    with pytest.raises(DumpError, match=r"unsupported dump format version 3; this rayless reads \[1, 2\]"):
        read_all_ways(dump_file)
    dump_file.write_bytes(b"PK\x03\x04" + data[4:])
    with pytest.raises(DumpError, match=r"wrong magic bytes.*rayless dump convert"):
        read_all_ways(dump_file)


def test_empty_file_directory_and_missing_file(tmp_path: Path) -> None:
    empty = tmp_path / "0.rld"
    empty.write_bytes(b"")
    with pytest.raises(DumpError, match=r"0\.rld: empty file"):
        read_all_ways(empty)
    with pytest.raises(DumpError, match="is a directory"):
        read_all_ways(tmp_path)
    with pytest.raises(DumpError, match="no such file"):
        read_all_ways(tmp_path / "absent.rld")


def handmade_dump(path: Path, records: list[dict[str, Any]], *, fields: list[str] | None = None) -> Path:
    """A dump with valid framing and checksums around arbitrary records, to reach the schema checks."""
    header = {
        "format_version": fmt.FORMAT_VERSION, "rollout_id": 1, "kind": "rollout", "created_at": 1.0,
        "sample_count": len(records), "sample_fields": fields or list(fmt.SAMPLE_FIELDS), "config": {},
    }  # fmt: skip
    out = bytearray(fmt.MAGIC + struct.pack("<H", fmt.FORMAT_VERSION))
    out += fmt.encode_frame(b"H", fmt.packb(header))[0]
    chain = 0
    for record in records:
        frame, crc = fmt.encode_frame(b"S", fmt.packb(record))
        out += frame
        chain = zlib.crc32(struct.pack("<I", crc), chain)
    out += fmt.encode_frame(b"T", fmt.packb({"sample_count": len(records), "chain": chain}))[0]
    path.write_bytes(bytes(out))
    return path


def good_record() -> dict[str, Any]:
    return msgpack.unpackb(fmt.encode_sample(make_sample()), raw=False)


def test_handmade_valid_record_reads(tmp_path: Path) -> None:
    # Guards the helper: the refusals below come from the mutation, not from a broken hand-made file.
    assert read_dump(handmade_dump(tmp_path / "1.rld", [good_record()])).samples == [make_sample()]


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda r: r.update(loss_mask=fmt.pack_ints([1, 1])), "wrong lengths: .*loss_mask has 2 entries"),
        (lambda r: r.update(rollout_log_probs=fmt.pack_floats([0.0])), "wrong lengths: .*rollout_log_probs"),
        (lambda r: r.update(response_length=99), "wrong lengths: .*response_length 99 outside"),
        (lambda r: r.update(extra=1), r"unknown \['extra'\]"),
        (lambda r: r.pop("reward"), r"missing \['reward'\]"),
        (lambda r: r.update(tokens=[1, 2, 3, 4]), "tokens must be a packed integer array"),
        (lambda r: r.update(group_index="0"), "group_index must be an int"),
        (lambda r: r.update(status="exploded"), "status 'exploded' is not one of"),
        (lambda r: r.update(reward=[1.0]), "reward must be a float"),
        (lambda r: r.update(metadata=msgpack.ExtType(99, b"")), "unknown msgpack extension type 99"),
    ],
)
def test_schema_and_length_errors(tmp_path: Path, mutate: Any, message: str) -> None:
    record = good_record()
    mutate(record)
    path = handmade_dump(tmp_path / "1.rld", [record])
    with pytest.raises(DumpError, match=rf"1\.rld: sample #0 of 1: .*{message}"):
        read_all_ways(path)


def test_unknown_sample_field_in_header(tmp_path: Path) -> None:
    path = handmade_dump(tmp_path / "1.rld", [good_record()], fields=[*fmt.SAMPLE_FIELDS, "teacher_logprobs"])
    with pytest.raises(DumpError, match=r"sample fields this rayless does not know: \['teacher_logprobs'\]"):
        read_all_ways(path)


def test_reordered_and_dropped_records_are_detected(dump_file: Path, tmp_path: Path) -> None:
    data = dump_file.read_bytes()
    # Split into frames by walking the lengths: head, header, 4 samples, trailer.
    offset, frames = 10, []
    while offset < len(data):
        _, length, _ = fmt.FRAME_HEAD.unpack_from(data, offset)
        frames.append(data[offset : offset + fmt.FRAME_HEAD.size + length])
        offset += fmt.FRAME_HEAD.size + length
    head, header, *sample_frames, trailer = data[:10], frames[0], *frames[1:]
    assert len(sample_frames) == 4
    swapped = tmp_path / "swapped.rld"
    swapped.write_bytes(
        head + header + sample_frames[1] + sample_frames[0] + b"".join(sample_frames[2:]) + trailer
    )
    with pytest.raises(DumpError, match="dropped, duplicated or reordered"):
        read_all_ways(swapped)
    dropped = tmp_path / "dropped.rld"
    dropped.write_bytes(head + header + b"".join(sample_frames[:3]) + trailer)
    with pytest.raises(DumpError, match="expected sample #3 of 4, found a frame tagged b'T'"):
        read_all_ways(dropped)
    appended = tmp_path / "appended.rld"
    appended.write_bytes(data + b"\x00")
    with pytest.raises(DumpError, match="1 unexpected bytes after the trailer"):
        read_all_ways(appended)


def test_streaming_yields_good_samples_before_the_fault(dump_file: Path) -> None:
    data = bytearray(dump_file.read_bytes())
    data[-3] ^= 0xFF  # inside the trailer
    dump_file.write_bytes(bytes(data))
    stream = iter_samples(dump_file)
    got = [next(stream) for _ in range(4)]
    assert [s.group_index for s in got] == [0, 0, 1, 1]
    with pytest.raises(DumpError, match="checksum mismatch in the trailer"):
        next(stream)


@pytest.mark.parametrize("label", [1, 2.5, "1", None, [1, "a"], {"answer": 2}])
def test_a_label_keeps_its_json_type_through_a_dump(tmp_path: Path, label: Any) -> None:
    """A run's label is the data file's JSON value (coordinator.data.source.label_value); a dump and its replay
    keep it, so `1` (a gpqa choice index) does not come back as `"1"`."""
    sample = Sample(group_index=0, sample_index=0, prompt="p", tokens=[1, 2, 3], response_length=1, loss_mask=[1],
                    rollout_log_probs=[-0.5], status=SampleStatus.COMPLETED, reward=1.0, label=label, response="x")
    path = write_dump(tmp_path / "d.dump", 0, [sample], config_facts={})
    (back,) = read_dump(path).samples
    assert back.label == label and type(back.label) is type(label)
