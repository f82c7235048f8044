"""The verifiers adapter's own rules, on the real example environments: the dataset written as prompt data
carries what the rollout needs, the rollout's sampling params override the environment's, and a missing or
malformed environment setting is a clear error naming the variable."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from coordinator.sessions.verifiers_agent import (
    ARGS_VAR,
    ENV_VAR,
    export_dataset,
    load_env,
    rollout_input,
    run_agent,
    sampling_args,
)

pytest.importorskip("verifiers", reason="the `verifiers` extra (in `dev`) is not installed")

ECHO = "examples.verifiers_env.echo_env"


def test_the_dataset_becomes_prompt_data_the_rollout_input_is_rebuilt_from(tmp_path: Path) -> None:
    env = load_env(ECHO, {"repeats": 1})
    assert load_env(ECHO, {"repeats": 1}) is env  # built once per process
    rows = export_dataset(env, tmp_path / "echo.jsonl")
    lines = [json.loads(line) for line in (tmp_path / "echo.jsonl").read_text().splitlines()]
    assert rows == len(lines) == 10
    for index, line in enumerate(lines):
        assert line["prompt"] == [{"role": "user", "content": str(index)}]
        assert line["label"] == line["metadata"]["answer"] == str(index)
        built = rollout_input(line["prompt"], {**line["metadata"], "session_server_id": "x"})
        assert built == {"prompt": line["prompt"], "example_id": line["metadata"]["example_id"],
                         "answer": str(index)}


def test_the_rollouts_sampling_params_override_the_environments() -> None:
    env = load_env(ECHO)
    merged = sampling_args(env, {"max_tokens": 3, "temperature": 0.5, "stop_regex": []})
    assert merged["max_tokens"] == 3 and merged["temperature"] == 0.5
    assert merged["stop_regex"] == ["[0-9]"]  # an empty list from the rollout leaves the environment's
    assert sampling_args(env, {"stop_regex": ["x"]})["stop_regex"] == ["x"]  # a given one wins
    assert env.sampling_args["stop_regex"] == ["[0-9]"]  # the environment's own not mutated


@pytest.mark.parametrize(("env", "args", "message"), [
    (None, None, ENV_VAR),
    (ECHO, "{not json", f"{ARGS_VAR} is not JSON"),
    (ECHO, "[1]", f"{ARGS_VAR} must be a JSON object"),
])
async def test_the_generic_agent_names_the_variable_it_lacks(monkeypatch: pytest.MonkeyPatch, env: str | None,
                                                             args: str | None, message: str) -> None:
    for name, value in ((ENV_VAR, env), (ARGS_VAR, args)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=message):
        await run_agent(base_url="http://127.0.0.1:1/sessions/x", prompt=[], request_kwargs={}, metadata={})
