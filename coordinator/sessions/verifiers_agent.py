"""Any `verifiers` environment as a miles agent (`--custom-agent-function-path`): its rollout runs against the
sample's session `base_url`, so the session server records exactly the tokens and logprobs it trains on.

Owns the bridge between the two contracts: a sample's prompt and metadata (`answer`, `info`, `example_id`,
`task`, as `export_dataset` writes them) become the environment's `RolloutInput`; the rollout's sampling
params (`request_kwargs`) override its own `sampling_args`; its client is verifiers' own OpenAI chat-completions
client over an `AsyncOpenAI` pointed at `base_url + "/v1"`; the rubric's reward and metrics come back in the
returned dict (merged into the sample's metadata; `reward` below reads it for `--custom-rm-path`).
Environments load as verifiers loads them (`verifiers.load_environment`: a module path or an installed
environment's id, its `load_environment(**args)` called once per process and cached).

Invariant: a rollout that verifiers marks as failed (`error` in its output) raises, so the sample is aborted
rather than trained on a half-finished conversation. Written against verifiers 0.3's classic API.
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import os
import ssl
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from replay.sample import Sample
from workers.boundary.json_input import JsonObject, JsonValue

ENV_VAR = "RAYLESS_VERIFIERS_ENV"
ARGS_VAR = "RAYLESS_VERIFIERS_ENV_ARGS"
MODEL = "policy"  # the session server serves one model whatever the name; verifiers requires one
_INPUT_FIELDS = ("answer", "info", "example_id", "task")

_ENVS: dict[str, Any] = {}


@functools.cache
def _tls() -> ssl.SSLContext:
    """One TLS context for every rollout's client: building one per client costs ~90 ms each here (measured), and a
    rollout starts hundreds of samples at once."""
    return ssl.create_default_context()


def load_env(env_id: str, env_args: JsonObject | None = None) -> Any:
    """The environment `env_id` (a module path or an installed environment's id), built once per process."""
    import verifiers as vf

    from coordinator.lifecycle.failures import file_only_logger

    # verifiers logs each failed rollout with its own stderr handler ("Aborted rollout due to ..."); the agent
    # reports the same failure (`coordinator.sessions.agentic`): verifiers' records go to the run's log only.
    file_only_logger("verifiers")
    key = json.dumps([env_id, env_args or {}], sort_keys=True)
    if key not in _ENVS:
        _ENVS[key] = vf.load_environment(env_id, **(env_args or {}))
    return _ENVS[key]


def _from_environment() -> tuple[str, JsonObject]:
    env_id = os.environ.get(ENV_VAR, "")
    if not env_id:
        raise ValueError(f"coordinator.sessions.verifiers_agent.run_agent needs {ENV_VAR}=<module or "
                         "environment id> (the verifiers environment to run); or build an agent with "
                         "make_agent(env_id)")
    raw = os.environ.get(ARGS_VAR, "{}")
    try:
        env_args = json.loads(raw)
    except json.JSONDecodeError as error:
        raise ValueError(f"{ARGS_VAR} is not JSON ({error}): {raw!r}") from None
    if not isinstance(env_args, dict):
        raise ValueError(f"{ARGS_VAR} must be a JSON object of load_environment's keyword arguments: {raw!r}")
    return env_id, env_args


def rollout_input(prompt: JsonValue, metadata: JsonObject) -> JsonObject:
    """verifiers' `RolloutInput` for one sample: the prompt as the data holds it, the rest from metadata."""
    row: dict[str, Any] = {"prompt": prompt, "example_id": int(metadata.get("example_id", 0))}
    row.update({field: metadata[field] for field in ("answer", "info", "task") if field in metadata})
    return row


def sampling_args(env: Any, request_kwargs: JsonObject) -> JsonObject:
    """The environment's own sampling args (e.g. its stop strings) overridden by the rollout's, as verifiers'
    `Environment.generate` merges them; the rollout's empty lists (no stop given) leave the environment's."""
    merged = copy.deepcopy(getattr(env, "sampling_args", None) or {})
    merged.update({key: value for key, value in request_kwargs.items() if value is not None and value != []})
    return merged


async def run_env_rollout(env: Any, *, base_url: str, prompt: JsonValue, request_kwargs: JsonObject,
                          metadata: JsonObject, api_key: str = "EMPTY") -> JsonObject:
    """One rollout of `env` through the session at `base_url`; the rubric's reward and metrics returned."""
    from openai import AsyncOpenAI, DefaultAsyncHttpxClient
    from verifiers.clients import OpenAIChatCompletionsClient

    openai = AsyncOpenAI(base_url=f"{base_url}/v1", api_key=api_key, max_retries=0, timeout=600,
                         http_client=DefaultAsyncHttpxClient(verify=_tls()))
    try:  # a client per rollout, closed with it: its connections belong to this rollout's loop
        output = await env.run_rollout(rollout_input(prompt, metadata), OpenAIChatCompletionsClient(openai),
                                       MODEL, sampling_args(env, request_kwargs))
    finally:
        await openai.close()
    if output.get("error"):
        raise RuntimeError(f"verifiers rollout failed: {output['error']}")
    return {"reward": float(output["reward"]), "verifiers_metrics": dict(output.get("metrics") or {}),
            "verifiers_stop": output.get("stop_condition")}


AgentFn = Callable[..., Awaitable[dict[str, Any]]]


def make_agent(env_id: str, **env_args: JsonValue) -> AgentFn:
    """A miles agent running the verifiers environment `env_id` (built with `env_args`) for each sample."""

    async def run_agent(*, base_url: str, prompt: JsonValue, request_kwargs: JsonObject, metadata: JsonObject,
                        api_key: str = "EMPTY", **kwargs: object) -> JsonObject:
        return await run_env_rollout(load_env(env_id, env_args), base_url=base_url, prompt=prompt,
                                     request_kwargs=request_kwargs, metadata=metadata, api_key=api_key)

    return run_agent


async def run_agent(*, base_url: str, prompt: JsonValue, request_kwargs: JsonObject, metadata: JsonObject,
                    api_key: str = "EMPTY", **kwargs: object) -> JsonObject:
    """The agent for `--custom-agent-function-path coordinator.sessions.verifiers_agent.run_agent`: the
    environment named by $RAYLESS_VERIFIERS_ENV (its arguments, JSON, in $RAYLESS_VERIFIERS_ENV_ARGS)."""
    env_id, env_args = _from_environment()
    return await run_env_rollout(load_env(env_id, env_args), base_url=base_url, prompt=prompt,
                                 request_kwargs=request_kwargs, metadata=metadata, api_key=api_key)


async def reward(args: argparse.Namespace, sample: Sample, **kwargs: object) -> float:
    """`--custom-rm-path coordinator.sessions.verifiers_agent:reward`: the rubric's reward the agent left."""
    return float((sample.metadata or {}).get("reward", 0.0))


def _plain(value: object) -> JsonValue:
    """A dataset cell as JSON: verifiers' message models (pydantic) dumped, the rest kept."""
    if hasattr(value, "model_dump"):
        return value.model_dump(exclude_none=True)
    if isinstance(value, list):
        return [_plain(item) for item in value]
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    return value


def export_dataset(env: Any, path: Path, *, eval_split: bool = False, limit: int = -1) -> int:
    """Write the environment's dataset as `--prompt-data` JSONL (`prompt`, `label` = the answer, `metadata`
    holding what the rollout needs); returns the row count. Train with `--input-key prompt --label-key label
    --metadata-key metadata`."""
    dataset = env.get_eval_dataset(n=limit) if eval_split else env.get_dataset(n=limit)
    rows = 0
    with path.open("w") as out:
        for index, row in enumerate(dataset):
            metadata = {field: _plain(row[field]) for field in _INPUT_FIELDS if row.get(field) is not None}
            metadata.setdefault("example_id", index)
            out.write(json.dumps({"prompt": _plain(row["prompt"]), "label": str(row.get("answer") or ""),
                                  "metadata": metadata}) + "\n")
            rows += 1
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m coordinator.sessions.verifiers_agent",
                                     description="Write a verifiers environment's dataset as rayless prompt data")
    parser.add_argument("env_id", help="the environment: a module path or an installed environment's id")
    parser.add_argument("output", type=Path, help="the JSONL file to write")
    parser.add_argument("--env-args", default="{}", help="load_environment's keyword arguments, as JSON")
    parser.add_argument("--eval", action="store_true", help="the environment's eval dataset instead")
    parser.add_argument("--limit", type=int, default=-1, help="at most this many rows (-1: all)")
    options = parser.parse_args(argv)
    try:
        env_args = json.loads(options.env_args)
    except json.JSONDecodeError as error:
        parser.error(f"--env-args is not JSON: {error}")
    rows = export_dataset(load_env(options.env_id, env_args), options.output, eval_split=options.eval,
                          limit=options.limit)
    print(f"wrote {rows} rows to {options.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
