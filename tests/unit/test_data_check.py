"""The start-up check of a whole data file (`coordinator.data.check`) and the rows it reads (`data.lines`).

Properties: any bytes are a record count or one DataSourceError, never another exception; the first bad line
is named by its number, with the count of the others; a line over the limit is refused naming the flag that
raises it, and read without holding it whole; the run's reader agrees with the check on every file.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from coordinator.data.check import RecordKeys, check_data_file
from coordinator.data.lines import LIMIT_FLAG
from coordinator.data.source import DataSourceError, read_prompt_file
from tests.support.memory import PeakMemory

KEYS = RecordKeys(input_key="prompt", label_key="label")
RECORD = st.fixed_dictionaries({"prompt": st.text(max_size=30), "label": st.one_of(st.text(max_size=5),
                                                                                  st.integers())})
# Lines a hostile file may hold: good records, valid JSON of the wrong shape, bytes that are not JSON at all.
JSON_VALUES = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                                      max_size=3), max_leaves=6)
LINES = st.one_of(RECORD.map(lambda r: json.dumps(r).encode()), JSON_VALUES.map(lambda v: json.dumps(v).encode()),
                  st.binary(max_size=40).filter(lambda b: b"\n" not in b))


def write_lines(path: Path, lines: list[bytes]) -> Path:
    path.write_bytes(b"".join(line + b"\n" for line in lines))
    return path


def good_lines(n: int) -> list[bytes]:
    return [json.dumps({"prompt": f"{i} 7 1=", "label": str(i)}).encode() for i in range(n)]


@settings(max_examples=150, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lines=st.lists(LINES, max_size=8))
def test_any_file_is_a_count_or_one_data_source_error_and_the_reader_agrees(tmp_path: Path,
                                                                             lines: list[bytes]) -> None:
    path = write_lines(tmp_path / "data.jsonl", lines)
    try:
        count = check_data_file(path, KEYS, max_line_bytes=64)
    except DataSourceError as error:
        assert str(error).startswith(str(path)) and "\n" not in str(error)
        with pytest.raises(DataSourceError):
            read_prompt_file(path, input_key="prompt", label_key="label", max_line_bytes=64)
        return
    records = read_prompt_file(path, input_key="prompt", label_key="label", max_line_bytes=64)
    assert len(records) == count == sum(1 for line in lines if line.strip())


@settings(max_examples=60, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(n=st.integers(2, 300), data=st.data())
def test_the_first_bad_line_is_named_with_the_count_of_the_rest(tmp_path: Path, n: int, data: st.DataObject) -> None:
    bad_at = sorted(data.draw(st.sets(st.integers(0, n - 1), min_size=1, max_size=4)))
    kinds = [b'{"prompt": 3, "label": "x"}', b'{"label": "no prompt"}', b"[1, 2]", b"{not json",
             b'{"prompt": "caf\xe9", "label": "x"}', b'{"prompt": ' + b"[" * 100 + b"]" * 100 + b', "label": "x"}']
    lines = good_lines(n)
    for position in bad_at:
        lines[position] = data.draw(st.sampled_from(kinds))
    path = write_lines(tmp_path / "data.jsonl", lines)
    with pytest.raises(DataSourceError) as error:
        check_data_file(path, KEYS)
    message = str(error.value)
    assert message.startswith(f"{path}:{bad_at[0] + 1}: ")
    assert (f"(and {len(bad_at) - 1} further bad line(s) of {n})" in message) == (len(bad_at) > 1)


@pytest.mark.parametrize(("line", "reason"), [
    (b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nested deeper than"),
    (b'{"prompt": "caf\xe9"}', "not UTF-8 text (byte 15 of the line is 0xe9)"),
    (b'{"prompt": "x", "label": NaN}', "not valid JSON"),
    (b'"just text"', "each line must be a JSON object, got str"),
    (b'{"prompt": {"role": "user"}}', "expected a string or a list of chat messages"),
])
def test_each_kind_of_bad_line_is_one_reason(tmp_path: Path, line: bytes, reason: str) -> None:
    path = write_lines(tmp_path / "data.jsonl", [*good_lines(3), line])
    with pytest.raises(DataSourceError, match=f"^{path}:4: ") as error:
        check_data_file(path, RecordKeys())
    assert reason in str(error.value)


def test_a_line_over_the_limit_is_refused_naming_the_flag_without_being_held(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "data.jsonl", [b'{"prompt": "' + b"x" * (16 << 20) + b'"}', *good_lines(2)])
    peak = PeakMemory()
    with pytest.raises(DataSourceError) as error:
        check_data_file(path, RecordKeys(), max_line_bytes=1 << 20)
    assert peak.growth_mib < 8, "the 16 MiB line was read whole"
    assert f"{path}:1: a line of {(16 << 20) + 15} bytes is over the limit of 1048576 bytes" in str(error.value)
    assert LIMIT_FLAG in str(error.value)
    # raised, the same line is a record
    assert check_data_file(path, RecordKeys(), max_line_bytes=17 << 20) == 3


def test_metadata_given_as_a_json_string_is_decoded_within_the_same_bounds(tmp_path: Path) -> None:
    keys = RecordKeys(metadata_key="m")
    fine = write_lines(tmp_path / "fine.jsonl", [json.dumps({"prompt": "p", "m": '{"k": [1]}'}).encode()])
    assert check_data_file(fine, keys) == 1
    deep = write_lines(tmp_path / "deep.jsonl", [json.dumps({"prompt": "p", "m": "[" * 5000 + "]" * 5000}).encode()])
    with pytest.raises(DataSourceError, match="metadata key 'm' is a string but not JSON: JSON nested deeper"):
        check_data_file(deep, keys)


def test_parquet_rows_are_checked_by_batches_with_the_same_rules(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    rows = [{"prompt": f"p{i}", "label": str(i)} for i in range(2500)]
    path = tmp_path / "data.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    assert check_data_file(path, KEYS) == 2500
    rows[2100] = {"prompt": "x" * 5000, "label": "big"}
    pq.write_table(pa.Table.from_pylist(rows), path)
    with pytest.raises(DataSourceError, match=f"^{path}: row 2101: a row of more than 4096 bytes"):
        check_data_file(path, KEYS, max_line_bytes=4096)
    with pytest.raises(DataSourceError, match="key 'answer' \\(--label-key\\) is missing"):
        check_data_file(path, RecordKeys(label_key="answer"))


def test_an_empty_or_missing_file_is_named(tmp_path: Path) -> None:
    empty = write_lines(tmp_path / "empty.jsonl", [b"", b"  "])
    with pytest.raises(DataSourceError, match="holds no records"):
        check_data_file(empty, RecordKeys())
    with pytest.raises(DataSourceError, match="no such file"):
        check_data_file(tmp_path / "nope.jsonl", RecordKeys())


def test_reward_score_reads_its_rows_through_the_same_boundary(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    from coordinator.cli import main

    data = write_lines(tmp_path / "rows.jsonl", [b'{"response": "Answer: 3", "label": "3"}',
                                                b'{"response": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
                                                b'{"response": "caf\xe9", "label": "3"}'])
    assert main(["reward", "score", "--rm-type", "dapo", str(data)]) == 1
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert rows[0] == {"index": 0, "reward": {"score": 1.0, "acc": 1.0}}
    assert "line 2 is not JSON within bounds (JSON nested deeper than 64 levels)" in rows[1]["error"]
    assert "line 3 is not JSON within bounds" in rows[2]["error"] and "UTF-8" in rows[2]["error"]


def test_numbers_beyond_64_bits_read_as_json_reads_them(tmp_path: Path) -> None:
    big = 123456789012345678901234567890
    path = write_lines(tmp_path / "big.jsonl", [json.dumps({"prompt": "p", "label": big, "m": {"id": big}}).encode()])
    assert check_data_file(path, RecordKeys(label_key="label", metadata_key="m")) == 1
    (record,) = read_prompt_file(path, label_key="label", metadata_key="m")
    assert record.label == str(big) and record.metadata == {"id": big}
    deep = write_lines(tmp_path / "deep_big.jsonl", [b'{"prompt": "p", "x": ' + b"[" * 40 + str(big).encode()
                                                      + b"]" * 40 + b"}"])
    with pytest.raises(DataSourceError, match=f"^{deep}:1: "):  # too deep for the fallback: refused
        check_data_file(deep, RecordKeys())
