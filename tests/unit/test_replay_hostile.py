"""Dumps and `.pt` files with valid checksums but hostile structure: every one is a DumpError, never another
exception, a crash or a blow-up of memory.

The property tests generate dump bytes three ways (random payloads, byte mutations of valid records, valid
msgpack of the wrong shapes), always inside frames with correct CRCs and trailer chain, so only the
structure checks can refuse them. The bombs run in a fresh interpreter that reports its peak memory growth.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from replay import bounds
from replay import format as fmt
from replay.format import DumpError
from replay.loader import ReplayLoader
from replay.reader import iter_samples, read_dump
from replay.tools import main as dump_main
from tests.support import hostile_dumps as hostile

MIB = 1024 * 1024
# memory a refused hostile input may cost, and a generous hang guard (not a timing assertion)
MEMORY_BOUND_MIB = 256
HANG_GUARD_S = 60.0


def read_every_way(path: Path) -> None:
    """Everything that reads a dump: whole, streamed, by the replay loader, and the two CLI readers. Each
    may raise DumpError only; the CLI must exit 0 or 1."""
    outcomes = []
    for read in (lambda: read_dump(path), lambda: list(iter_samples(path)),
                 lambda: ReplayLoader(str(path.parent / "{rollout_id}.rld")).load_rollout(1)):
        try:
            read()
            outcomes.append("ok")
        except DumpError:
            outcomes.append("refused")
    assert dump_main(["verify", str(path)]) in (0, 1)
    assert dump_main(["show", str(path)]) in (0, 1)
    assert outcomes[0] == outcomes[1], outcomes  # the streaming and the whole reader agree


# ---------------------------------------------------------------------------------- generated inputs

good_payload = fmt.encode_sample(hostile.good_sample())
good_header = fmt.packb(hostile.good_header())

msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=6)
    | st.binary(max_size=6)
    | st.builds(msgpack.ExtType, st.sampled_from([1, 10, 11, 12, 13, 99]), st.binary(max_size=17))
    | st.builds(msgpack.Timestamp, st.integers(0, 2**32 - 1), st.integers(0, 999_999_999)),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=4), children, max_size=4),
    max_leaves=12,
)


def packed_map(record: dict[Any, Any]) -> bytes:
    return msgpack.packb(record, use_bin_type=True)


def raw_record(payload: bytes) -> dict[Any, Any]:
    return msgpack.unpackb(payload, raw=False, ext_hook=msgpack.ExtType, strict_map_key=False)


@st.composite
def mutated_payloads(draw: st.DrawFn, base: bytes) -> bytes:
    """A valid payload with bytes replaced, inserted or deleted."""
    data = bytearray(base)
    for _ in range(draw(st.integers(1, 4))):
        position = draw(st.integers(0, max(len(data) - 1, 0)))
        action = draw(st.sampled_from(["replace", "insert", "delete"]))
        byte = draw(st.integers(0, 255))
        if action == "replace" and data:
            data[position] = byte
        elif action == "insert":
            data.insert(position, byte)
        elif data:
            del data[position]
    return bytes(data)


@st.composite
def reshaped_records(draw: st.DrawFn, base: bytes) -> bytes:
    """A valid record with one field given a value of any shape, removed, or an odd key added."""
    record = raw_record(base)
    keys = sorted(record, key=str)
    action = draw(st.sampled_from(["replace", "remove", "add"]))
    if action == "replace":
        record[draw(st.sampled_from(keys))] = draw(msgpack_values)
    elif action == "remove":
        record.pop(draw(st.sampled_from(keys)))
    else:
        key = draw(st.one_of(st.text(max_size=4), st.integers(-(2**63), 2**63 - 1), st.booleans()))
        record[key] = draw(msgpack_values)
    payload = packed_map(record)
    if draw(st.booleans()):
        # a key msgpack cannot hash: a list in key position (written by hand: packb would refuse it)
        payload = bytes([payload[0] + 1]) + payload[1:] + b"\x91\x00\x00" if payload[0] < 0x8F else payload
    return payload


def check_framed(header: bytes, samples: list[bytes], trailer: bytes | None = None) -> None:
    with tempfile.TemporaryDirectory() as directory:
        read_every_way(hostile.framed_dump(Path(directory) / "1.rld", header, samples, trailer))


PROPERTY = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@PROPERTY
@given(where=st.sampled_from(["header", "sample", "trailer"]), payload=st.binary(max_size=64))
def test_random_payloads_are_dump_errors(where: str, payload: bytes) -> None:
    if where == "header":
        check_framed(payload, [good_payload])
    elif where == "sample":
        check_framed(good_header, [payload])
    else:
        check_framed(good_header, [good_payload], trailer=payload)


@PROPERTY
@given(data=st.data(), where=st.sampled_from(["header", "sample"]))
def test_byte_mutations_of_valid_records_are_dump_errors_or_valid(data: st.DataObject, where: str) -> None:
    if where == "header":
        check_framed(data.draw(mutated_payloads(good_header)), [good_payload])
    else:
        check_framed(good_header, [data.draw(mutated_payloads(good_payload))])


@PROPERTY
@given(data=st.data(), where=st.sampled_from(["header", "sample", "trailer"]))
def test_valid_msgpack_of_the_wrong_shape_is_a_dump_error_or_valid(data: st.DataObject, where: str) -> None:
    if where == "header":
        check_framed(data.draw(reshaped_records(good_header)), [good_payload])
    elif where == "sample":
        check_framed(good_header, [data.draw(reshaped_records(good_payload))])
    else:
        trailer = fmt.packb({"sample_count": 1, "chain": 0})
        check_framed(good_header, [good_payload], trailer=data.draw(reshaped_records(trailer)))


def test_the_generators_reach_a_valid_dump(tmp_path: Path) -> None:
    # Guards the helpers: a refusal above comes from the mutation, not from a broken hand-made file.
    path = hostile.framed_dump(tmp_path / "1.rld", good_header, [good_payload])
    assert read_dump(path).samples == [hostile.good_sample()]
    assert dump_main(["verify", str(path)]) == 0


# --------------------------------------------------------------------------------- nesting and size


def test_an_extension_nested_200_deep_is_refused_not_a_segfault(tmp_path: Path) -> None:
    path = hostile.nested_tuple_dump(tmp_path / "1.rld", 200)
    result = hostile.peak_rss_growth(
        "from replay.reader import read_dump",
        f"read_dump({str(path)!r})",
        timeout_s=HANG_GUARD_S,
    )
    assert result["error"] is not None and result["error"].startswith("DumpError"), result
    assert "nest deeper than 32 levels" in result["error"]
    assert result["growth_mib"] <= MEMORY_BOUND_MIB, result
    # and through the CLI: exit 1 with the reason, not 139
    assert dump_main(["verify", str(path)]) == 1


def test_nesting_up_to_the_bound_reads_and_one_more_is_refused(tmp_path: Path) -> None:
    # the record (1) > metadata (2) > k nested tuples: k + 2 levels
    fits = hostile.nested_tuple_dump(tmp_path / "1.rld", bounds.MAX_DEPTH - 2)
    value = read_dump(fits).samples[0].metadata["x"]
    for _ in range(bounds.MAX_DEPTH - 3):
        assert type(value) is tuple and len(value) == 1
        value = value[0]
    assert value == ()
    over = hostile.nested_tuple_dump(tmp_path / "2.rld", bounds.MAX_DEPTH - 1)
    with pytest.raises(DumpError, match="nest deeper than 32 levels"):
        read_dump(over)


@pytest.mark.parametrize("depth", [40, 5000])
def test_deeply_nested_arrays_are_refused(tmp_path: Path, depth: int) -> None:
    payload = hostile.sample_payload(b"\x91" * depth + b"\x90")
    path = hostile.framed_dump(tmp_path / "1.rld", good_header, [payload])
    with pytest.raises(DumpError, match="nest deeper than 32 levels"):
        read_dump(path)


def test_a_record_of_empty_containers_is_refused_within_bounded_memory(tmp_path: Path) -> None:
    # 8 MiB of empty arrays decodes to ~600 MiB of lists: far more than any dump writer's record
    count = 8 * MIB
    payload = hostile.sample_payload(b"\xdd" + count.to_bytes(4, "big") + b"\x90" * count)
    path = hostile.framed_dump(tmp_path / "1.rld", good_header, [payload])
    result = hostile.peak_rss_growth("from replay.reader import read_dump", f"read_dump({str(path)!r})",
                                     timeout_s=HANG_GUARD_S)
    assert result["error"] is not None and "would decode to" in result["error"], result
    assert result["growth_mib"] <= MEMORY_BOUND_MIB, result


def test_the_writer_refuses_what_the_reader_would(tmp_path: Path) -> None:
    sample = hostile.good_sample()
    deep: Any = []
    for _ in range(bounds.MAX_DEPTH):
        deep = [deep]
    sample.metadata = {"deep": deep}
    with pytest.raises(DumpError, match=r"sample #0 .*nest deeper than 32 levels"):
        fmt.write_dump(tmp_path / "1.rld", 1, [sample], config_facts={})
    assert not list(tmp_path.iterdir())


# ---------------------------------------------------------------------------------------- .pt bombs

BOMBS = {
    "shared references": (hostile.shared_reference_bomb, "would expand to more than"),
    "deflated 1 GiB storage": (hostile.deflated_storage_zip, "zip entries unpack to"),
    "self reference": (hostile.self_reference, "contains itself"),
    "deep nesting": (hostile.deep_nesting, "nest deeper than 32 levels"),
}


@pytest.mark.parametrize("name", list(BOMBS))
def test_pt_bombs_are_refused_within_bounded_memory(tmp_path: Path, name: str) -> None:
    make, reason = BOMBS[name]
    source = make(tmp_path / "bomb.pt")
    assert source.stat().st_size < 2 * MIB
    result = hostile.peak_rss_growth(
        "from replay.torch_import import convert_torch_dump",
        f"convert_torch_dump({str(source)!r}, {str(tmp_path / 'out.rld')!r})",
        timeout_s=HANG_GUARD_S,
    )
    assert result["error"] is not None and result["error"].startswith("DumpError"), result
    assert reason in result["error"], result
    assert result["growth_mib"] <= MEMORY_BOUND_MIB, result
    assert not (tmp_path / "out.rld").exists()
    assert dump_main(["convert", str(source), str(tmp_path / "out.rld")]) == 1
