"""A miles-style agent for the session-server tests, written only against the `openai` SDK: two model turns
with a tool call between them (the tool's answer goes back as a `tool` message), and everything it received
returned for the test to compare with the dumped sample. The reward rule is the custom reward's (`reward`).
"""

from __future__ import annotations

from typing import Any

import openai


def calculator(expression: str) -> str:
    left, right = expression.split("+")
    return str(int(left) + int(right))


async def run_agent(*, base_url: str, prompt: list[dict[str, Any]], request_kwargs: dict[str, Any],
                    metadata: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
    messages = list(prompt)
    received: list[dict[str, Any]] = []
    key = kwargs.get("api_key", "EMPTY")  # given when the run has --sglang-api-key
    async with openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key=key, max_retries=0) as client:
        for turn in range(2):
            reply = await client.chat.completions.create(model="policy", messages=messages, extra_body=request_kwargs)
            choice = reply.choices[0]
            meta = choice.model_extra["meta_info"]
            received.append({"ids": [pair[1] for pair in meta["output_token_logprobs"]],
                             "logprobs": [entry.logprob for entry in choice.logprobs.content],
                             "finish": choice.finish_reason})
            messages.append({"role": "assistant", "content": choice.message.content})
            if choice.finish_reason != "stop" or turn == 1:
                break
            messages.append({"role": "tool", "content": calculator(prompt[-1]["content"])})
    answer = messages[-1]["content"] if messages[-1]["role"] == "assistant" else ""
    return {"received": received, "answer": answer, "tool_output": calculator(prompt[-1]["content"])}


async def reward(args: Any, sample: Any, **kwargs: Any) -> float:
    return float(sample.metadata.get("tool_output", "?") in sample.metadata.get("answer", ""))


#: What `abort(args)` was called with (the test of miles' abort hook reads it).
ABORTED: list[Any] = []


async def abort(args: Any) -> None:
    ABORTED.append(args)
