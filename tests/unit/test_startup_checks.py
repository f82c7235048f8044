"""Start-up checks that come before anything launches: a port the flags fix that something else holds, and a
response length no response can reach in the model's context. Each is exit 2 naming the flag, from
`rayless train` itself, with no child process started and no run directory written."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from coordinator.checks.preflight import check_response_length
from coordinator.cli import train_main
from coordinator.config import ConfigError, parse_config


def _flags(model: Path, run_dir: Path, *extra: str) -> list[str]:
    return ["--hf-checkpoint", str(model), "--prompt-data", "builtin:first_digit", "--rm-type", "first_digit",
            "--rollout-num-engines", "1", "--num-rollout", "1", "--rollout-batch-size", "1",
            "--n-samples-per-prompt", "1", "--run-dir", str(run_dir), *extra]


@pytest.fixture
def taken() -> Iterator[int]:
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        yield squatter.getsockname()[1]


def _children() -> set[int]:
    return {child.pid for child in psutil.Process().children(recursive=True)}


def test_a_taken_control_port_stops_the_run_before_any_process_starts(
        tiny_model_dir: Path, tmp_path: Path, taken: int, capsys: pytest.CaptureFixture[str]) -> None:
    before = _children()
    code = train_main(_flags(tiny_model_dir, tmp_path / "run", "--control-port", str(taken)))
    assert code == 2
    err = capsys.readouterr().err
    assert f"rayless train: error: --control-port {taken}: 127.0.0.1:{taken} is in use" in err
    assert "give another port (0: any free port)" in err
    assert _children() <= before, "no engine, rank or router was started"
    assert not (tmp_path / "run").exists(), "nothing was written"


def test_dry_run_reports_a_taken_port_among_its_problems(
        tiny_model_dir: Path, tmp_path: Path, taken: int, capsys: pytest.CaptureFixture[str]) -> None:
    assert train_main(_flags(tiny_model_dir, tmp_path / "run", "--status-port", str(taken), "--dry-run")) == 2
    assert f"--status-port {taken}: 127.0.0.1:{taken} is in use" in capsys.readouterr().err


def test_a_free_fixed_port_is_noted(tiny_model_dir: Path, tmp_path: Path) -> None:
    from coordinator.checks.preflight import check_ports
    from coordinator.engines.spec import free_port

    port = free_port()
    config = parse_config(_flags(tiny_model_dir, tmp_path / "run", "--control-port", str(port)))
    assert check_ports(config) == [f"--control-port {port}: the control channel at 127.0.0.1:{port}"]


def test_a_response_length_beyond_the_context_is_refused_with_the_choices(
        tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    context = json.loads((tiny_model_dir / "config.json").read_text())["max_position_embeddings"]
    before = _children()
    code = train_main(_flags(tiny_model_dir, tmp_path / "run", "--rollout-max-response-len", str(context)))
    assert code == 2
    err = capsys.readouterr().err
    assert f"--rollout-max-response-len {context}: no response can be that long: the context is {context}" in err
    assert f"Choose: --rollout-max-response-len {context - 1} or less" in err and "--sglang-context-length" in err
    assert _children() <= before and not (tmp_path / "run").exists()


def test_the_response_length_is_checked_against_every_bound_given(tiny_model_dir: Path, tmp_path: Path) -> None:
    context = json.loads((tiny_model_dir / "config.json").read_text())["max_position_embeddings"]
    fits = parse_config(_flags(tiny_model_dir, tmp_path, "--rollout-max-response-len", str(context - 1)))
    assert check_response_length(fits)[0].startswith(f"--rollout-max-response-len {context - 1}: fits")
    wider = parse_config(_flags(tiny_model_dir, tmp_path, "--rollout-max-response-len", str(context),
                                "--sglang-context-length", str(2 * context)))
    assert "fits the context of" in check_response_length(wider)[0]
    capped = parse_config(_flags(tiny_model_dir, tmp_path, "--rollout-max-response-len", str(context),
                                 "--rollout-max-context-len", str(context)))  # clipping to the cap is meant
    assert check_response_length(capped)[0].endswith(f"capped at --rollout-max-context-len {context}")
    beyond = parse_config(_flags(tiny_model_dir, tmp_path, "--rollout-max-response-len", str(context),
                                 "--rollout-max-context-len", str(2 * context)))  # a cap the model cannot hold
    with pytest.raises(ConfigError, match=f"or --rollout-max-context-len {context} to cap each prompt"):
        check_response_length(beyond)
    evaluation = parse_config(_flags(tiny_model_dir, tmp_path, "--eval-max-response-len", str(context)))
    with pytest.raises(ConfigError, match=f"^--eval-max-response-len {context}: no response"):
        check_response_length(evaluation)
    default = parse_config(_flags(tiny_model_dir, tmp_path))  # the default 1024 > 512: noted, not refused
    assert "(the default): longer than the context" in check_response_length(default)[0]
