"""A miles-style agent for the session-server tests, written only against the `openai` SDK: two model turns
with a tool call between them (the tool's answer goes back as a `tool` message; tools declared; the first reply
appended as the SDK dumps it, the second streamed), and everything it received returned for the test to
compare with the dumped sample. The reward rule is the custom reward's (`reward`).
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import openai

TOOLS = [{"type": "function", "function": {"name": "calculator", "description": "adds two numbers",
                                          "parameters": {"type": "object", "properties": {"expression": {
                                              "type": "string"}}}}}]


def calculator(expression: str) -> str:
    left, right = expression.split("+")
    return str(int(left) + int(right))


async def _streamed(client: openai.AsyncOpenAI, messages: list[dict[str, Any]],
                    request_kwargs: dict[str, Any]) -> dict[str, Any]:
    stream = await client.chat.completions.create(model="policy", messages=messages, stream=True, logprobs=True,
                                                  tools=TOOLS, extra_body=request_kwargs)
    text, entries, finish = "", [], None
    async for chunk in stream:
        for choice in chunk.choices:
            text += choice.delta.content or ""
            entries += (choice.logprobs.content if choice.logprobs else None) or []
            finish = choice.finish_reason or finish
    messages.append({"role": "assistant", "content": text})
    return {"ids": None, "tokens": [e.token for e in entries], "logprobs": [e.logprob for e in entries],
            "finish": finish}


async def run_agent(*, base_url: str, prompt: list[dict[str, Any]], request_kwargs: dict[str, Any],
                    metadata: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
    """Turn 1 plain (the reply appended as the SDK dumps it), the tool's answer as a `tool` message, turn 2
    streamed; what each turn received is returned (ids only where the answer carried meta_info)."""
    messages = list(prompt)
    received: list[dict[str, Any]] = []
    key = kwargs.get("api_key", "EMPTY")  # given when the run has --sglang-api-key
    async with openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key=key, max_retries=0) as client:
        reply = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS,
                                                     extra_body=request_kwargs)
        choice = reply.choices[0]
        meta = choice.model_extra["meta_info"]
        received.append({"ids": [pair[1] for pair in meta["output_token_logprobs"]],
                         "logprobs": [entry.logprob for entry in choice.logprobs.content],
                         "finish": choice.finish_reason})
        messages.append(choice.message.model_dump())
        if choice.finish_reason == "stop":
            messages.append({"role": "tool", "tool_call_id": "call_0", "content": calculator(prompt[-1]["content"])})
            received.append(await _streamed(client, messages, request_kwargs))
    answer = messages[-1]["content"] if messages[-1]["role"] == "assistant" else ""
    return {"received": received, "answer": answer or "", "tool_output": calculator(prompt[-1]["content"])}


async def reward(args: Any, sample: Any, **kwargs: Any) -> float:
    return float(sample.metadata.get("tool_output", "?") in sample.metadata.get("answer", ""))


#: What `abort(args)` was called with (the test of miles' abort hook reads it).
ABORTED: list[Any] = []


async def abort(args: Any) -> None:
    ABORTED.append(args)


async def failing_agent(*, base_url: str, prompt: list[dict[str, Any]], request_kwargs: dict[str, Any],
                        metadata: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
    """Makes one model call, then fails (an agent's bug or its environment's): the sample is aborted."""
    async with openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key=kwargs.get("api_key", "EMPTY"),
                                  max_retries=0) as client:
        await client.chat.completions.create(model="policy", messages=prompt, extra_body=request_kwargs)
    raise RuntimeError("the environment went away")


async def cancelling_agent(*, base_url: str, prompt: list[dict[str, Any]], request_kwargs: dict[str, Any],
                           metadata: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
    """Makes one model call, then raises a CancelledError of its own (an agent framework's timeout leaking out):
    nothing of the run's was cancelled, so the sample is aborted, as for any failure."""
    async with openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key=kwargs.get("api_key", "EMPTY"),
                                  max_retries=0) as client:
        await client.chat.completions.create(model="policy", messages=prompt, extra_body=request_kwargs)
    raise asyncio.CancelledError


def exiting_agent(**kwargs: Any) -> dict[str, Any]:
    """A synchronous agent calling sys.exit: it runs in a worker thread, and its exit aborts the sample only."""
    raise SystemExit(3)


async def hanging_agent(**kwargs: Any) -> dict[str, Any]:
    """Waits for ever (an environment that never answers): `--agent-timeout-s` ends the episode."""
    await asyncio.Event().wait()
    return {}


#: what `blocking_agent` waits for (the test sets it when done, so the abandoned thread ends with the test)
RELEASE = threading.Event()


def blocking_agent(**kwargs: Any) -> dict[str, Any]:
    """A synchronous agent blocked in a call that does not return: its thread is abandoned at the limit."""
    RELEASE.wait(600)
    return {}


async def silent_agent(**kwargs: Any) -> dict[str, Any]:
    """Returns without calling the model: its episode has nothing to train on."""
    return {"note": "did nothing"}
