"""Property: any config mapping or command line gives a valid Config or a ConfigError — never another exception.

Keys come from the real flag set (both spellings) plus junk; values are every YAML/JSON type, including nan,
±inf, integers beyond int64, nested lists, mappings and null. Half the mappings start from a valid job so that
the slices' checks and the cross-slice rules run too, not only the converters.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from coordinator.config import FLAGS, Config, ConfigError, ConfigWarning, parse_config, parse_config_mapping

VALID_JOB = {"hf-checkpoint": "/model", "rollout-batch-size": 4, "n-samples-per-prompt": 2, "num-rollout": 3,
             "prompt-data": "builtin:first_digit", "rollout-num-engines": 1}
NAMES = sorted(FLAGS)
KEYS = st.one_of(
    st.sampled_from(NAMES),
    st.sampled_from([name.replace("_", "-") for name in NAMES]),
    st.sampled_from(["--lr", "config", "sglang_passthrough", "given", ""]),
    st.text(max_size=12),
)
SCALARS = st.one_of(
    st.none(), st.booleans(),
    st.integers(), st.integers(min_value=2**62, max_value=2**80), st.integers(min_value=-(2**80), max_value=-1),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20),
    st.sampled_from(["nan", "inf", "-1", "0", "1e309", "127.0.0.1:1", "http://h:1", "a.b:C", "rollout,train",
                     "d/{rollout_id}.rld", "grpo", "math", "cpu"]),
)
VALUES = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner,
                                                                                           max_size=3), max_leaves=8)


def check(build: Any) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConfigWarning)
        try:
            config = build()
        except ConfigError:
            return
    assert isinstance(config, Config)
    config.to_json()  # every valid config can be written to the run directory
    try:
        _ = config.generate_concurrency
    except ConfigError:
        assert config.num_rollout_engines == 0


@settings(max_examples=300, deadline=None, database=None)
@given(extra=st.dictionaries(KEYS, VALUES, max_size=6), start_valid=st.booleans())
def test_any_mapping_is_a_config_or_a_config_error(extra: dict[str, Any], start_valid: bool) -> None:
    data: dict[Any, Any] = dict(VALID_JOB) if start_valid else {}
    data.update(extra)
    check(lambda: parse_config_mapping(data, origin="fuzz.yaml"))


FLAG_TOKENS = st.sampled_from(["--" + name.replace("_", "-") for name in NAMES] + ["--config", "--sglang-x",
                                                                                  "--nope", "--", "-x", "="])
ARG_VALUES = st.one_of(st.text(max_size=10).filter(lambda text: text not in ("-h", "--help")),
                       st.sampled_from(["nan", "-1", "0", str(2**70), "1.5", "a:b", "x/{rollout_id}"]))


@settings(max_examples=200, deadline=None, database=None)
@given(argv=st.lists(st.one_of(FLAG_TOKENS, ARG_VALUES), max_size=10))
def test_any_command_line_is_a_config_or_a_config_error(argv: list[str]) -> None:
    base = [token for key, value in VALID_JOB.items() for token in (f"--{key}", str(value))]
    check(lambda: parse_config([*base, *argv]))


@settings(max_examples=60, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(extra=st.dictionaries(st.sampled_from(NAMES), VALUES, max_size=4))
def test_any_yaml_file_is_a_config_or_a_config_error(tmp_path: Path, extra: dict[str, Any]) -> None:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump({**VALID_JOB, **extra}))
    check(lambda: parse_config(["--config", str(path)]))
