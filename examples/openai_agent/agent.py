"""An agent written only against the `openai` SDK (no rayless import) that rayless trains through miles'
session server: `rayless train --config examples/openai_agent/train.yaml --hf-checkpoint runs/tiny-model`.

The task: a prompt `3+4` (sum below 10). The model's turn ends at its first digit or `=` (the stop strings
the agent asks for). A digit is its answer; `=` calls the calculator, whose result comes back as a `tool`
message, and the model answers in a second turn. Reward 1.0 when the answer is the sum. The sum is in the
context only after a call, so the policy learns to call, then to copy what the tool said. The session server
records exactly the tokens the model wrote, so the tool's message is in the sample with loss mask 0.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from openai import AsyncOpenAI, DefaultAsyncHttpxClient

DIGITS = [str(i) for i in range(10)]
CALL = "="


_HTTP: dict[tuple[int, object], Any] = {}
_Client = TypeVar("_Client")


def pooled_client(factory: Callable[[], _Client] = DefaultAsyncHttpxClient) -> _Client:  # type: ignore[assignment]
    """One connection pool for every episode on this event loop: building a client per episode costs an SSL
    context each, and hundreds of episodes start at once. `factory` is the SDK's own HTTP client class (the
    `anthropic` SDK's for examples/harness_agents/messages_agent.py)."""
    key = (id(asyncio.get_running_loop()), factory)
    if key not in _HTTP:
        for stale in [k for k in _HTTP if k[0] != key[0]]:
            del _HTTP[stale]
        _HTTP[key] = factory()
    return _HTTP[key]


def calculator(expression: str) -> str:
    left, right = expression.split("+")
    return str(int(left) + int(right))


async def _turn(client: AsyncOpenAI, messages: list[dict[str, object]], request_kwargs: dict[str, object]) -> str:
    """One model turn; returns the stop it ended on (a digit or '='), or '' when it ran out of tokens."""
    extra = {key: value for key, value in request_kwargs.items() if key != "stop"}
    reply = await client.chat.completions.create(model="policy", messages=messages, stop=[*DIGITS, CALL],
                                                 logprobs=True, extra_body=extra)
    choice = reply.choices[0]
    messages.append({"role": "assistant", "content": choice.message.content})
    last = choice.logprobs.content[-1].token if choice.logprobs and choice.logprobs.content else ""
    return last if choice.finish_reason == "stop" and last in (*DIGITS, CALL) else ""


async def run_agent(*, base_url: str, prompt: list[dict[str, object]], request_kwargs: dict[str, object],
                    metadata: dict[str, object], **kwargs: object) -> dict[str, object]:
    """miles' agent contract: keyword arguments, the returned dict merged into the sample's metadata."""
    messages = list(prompt)
    expression = prompt[-1]["content"]
    client = AsyncOpenAI(base_url=f"{base_url}/v1", api_key=kwargs.get("api_key", "EMPTY"), max_retries=0,
                         timeout=600, http_client=pooled_client())
    ended = await _turn(client, messages, request_kwargs)
    called = ended == CALL
    if called:
        messages.append({"role": "tool", "content": calculator(expression)})
        ended = await _turn(client, messages, request_kwargs)
    answer = ended if ended in DIGITS else ""
    return {"reward": float(answer == calculator(expression)), "tool_calls": int(called), "answer": answer}


class _Scored(Protocol):
    metadata: dict[str, object]


async def reward(args: object, sample: _Scored, **kwargs: object) -> float:
    """The reward the agent left in the sample's metadata (`--custom-rm-path`)."""
    return float(sample.metadata.get("reward", 0.0))
