"""The boundary layer's decoders: bounded JSON and alias-free YAML, property-based and on hostile inputs."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from workers.boundary.errors import BoundaryError
from workers.boundary.json_input import (
    JsonLimits,
    check_depth,
    check_depth_of_bytes,
    decode_json,
    decode_json_async,
)
from workers.boundary.yaml_input import load_yaml

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8), inner, max_size=5),
    max_leaves=40,
)


@settings(max_examples=200, deadline=None)
@given(json_values)
def test_any_json_within_limits_decodes_to_what_the_standard_library_reads(value: object) -> None:
    text = json.dumps(value)
    assert decode_json(text, "peer") == json.loads(text)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=200))
def test_arbitrary_bytes_decode_or_raise_only_boundary_error(data: bytes) -> None:
    try:
        value = decode_json(data, "peer")
    except BoundaryError as exc:
        assert exc.source == "peer"
    else:
        assert not isinstance(value, float) or math.isfinite(value)


@pytest.mark.parametrize("depth", [65, 1_000, 200_000])
def test_deep_nesting_is_refused_with_the_source_named(depth: int) -> None:
    with pytest.raises(BoundaryError, match=r"^engine 127\.0\.0\.1:1: JSON nested deeper than 64"):
        decode_json("[" * depth + "]" * depth, "engine 127.0.0.1:1")


@settings(max_examples=300, deadline=None)
@given(json_values, st.integers(1, 6))
def test_the_depth_read_from_bytes_is_the_depth_of_the_decoded_value(value: object, max_depth: int) -> None:
    """`check_depth_of_bytes` (what a typed reader that skipped fields uses) agrees with `check_depth` on the
    decoded value, brackets and escaped quotes inside strings included."""
    raw = json.dumps(value).encode()

    def verdict(check: object, *args: object) -> bool:
        try:
            check(*args)  # type: ignore[operator]
        except BoundaryError:
            return False
        return True

    by_value = not isinstance(value, (list, dict)) or verdict(check_depth, value, "peer", max_depth)
    assert verdict(check_depth_of_bytes, raw, "peer", max_depth) == by_value
    tricky = json.dumps([{"[\"{": ["]]"]}]).encode()  # strings holding brackets, quotes and backslashes
    assert verdict(check_depth_of_bytes, tricky, "peer", 3) and not verdict(check_depth_of_bytes, tricky, "peer", 2)
    # no escaped quote, strings holding brackets (the pass that drops empty strings must fall back to the split)
    bracketed = json.dumps([{"a[": ["]"], "": "{{"}]).encode()
    assert verdict(check_depth_of_bytes, bracketed, "peer", 3) and not verdict(check_depth_of_bytes, bracketed, "peer", 2)


def test_many_small_containers_are_refused_before_any_is_built() -> None:
    body = b"[" + b"[]," * 3_000_000 + b"[]]"
    with pytest.raises(BoundaryError, match="more than 2000000 values"):
        decode_json(body, "hook client")


def test_commas_inside_strings_do_not_count_as_values() -> None:
    text = json.dumps({"prompt": "," * 50_000})
    assert decode_json(text, "file", JsonLimits(max_items=10))["prompt"] == "," * 50_000


@pytest.mark.parametrize("bad", ["[NaN]", "[Infinity]", "[1e400]", "{", "\udcff"])
def test_not_json_is_one_boundary_error(bad: str) -> None:
    with pytest.raises(BoundaryError, match=r"not valid JSON|over the limit"):
        decode_json(bad.encode("utf-8", "surrogateescape"), "peer")


def test_size_limit_is_checked_before_decoding() -> None:
    with pytest.raises(BoundaryError, match="over the limit of 10"):
        decode_json(b"[" + b"1," * 10 + b"1]", "peer", JsonLimits(max_bytes=10))


@pytest.mark.anyio
async def test_large_documents_decode_off_the_event_loop_to_the_same_value() -> None:
    body = json.dumps(list(range(300_000))).encode()
    assert await decode_json_async(body, "peer") == list(range(300_000))


def test_yaml_billion_laughs_is_refused_at_the_first_anchor() -> None:
    laughs = "a: &a [lol, lol]\n" + "".join(f"{c}: &{c} [*{p}, *{p}]\n" for p, c in zip("abcdefgh", "bcdefghi", strict=True))
    with pytest.raises(BoundaryError, match=r"^config\.yaml:1: anchors and aliases"):
        load_yaml(laughs, "config.yaml")


def test_yaml_errors_name_the_line_and_deep_nesting_is_refused() -> None:
    with pytest.raises(BoundaryError, match=r"^c\.yaml:3:"):
        load_yaml("x: 1\ny: [1, 2\n", "c.yaml")
    with pytest.raises(BoundaryError, match="nested deeper"):
        load_yaml("[" * 100_000, "c.yaml")
    with pytest.raises(BoundaryError, match="not UTF-8"):
        load_yaml(b"x: \xff\n", "c.yaml")


@settings(max_examples=100, deadline=None)
@given(json_values)
def test_plain_yaml_reads_as_the_safe_loader_reads_it(value: object) -> None:
    import yaml

    text = yaml.safe_dump(value)
    assert load_yaml(text, "c.yaml") == yaml.safe_load(text)
