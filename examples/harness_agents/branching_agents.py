"""Two agents whose conversations are not one line, written only against the `openai` SDK, as coding harnesses
behave: `with_sub_agent` hands part of its task to a sub-agent (its own system prompt and history, in the same
session) and gets its answer back as a tool result; `compacting` replaces its history with a summary midway, as
an auto-compaction does. The session server records each as a tree of messages, and the episode trains as one
sample per leaf (docs/openai.md#branching-agents-sub-agents-and-compaction).
"""

from __future__ import annotations

from openai import AsyncOpenAI


async def _say(client: AsyncOpenAI, messages: list[dict[str, object]], request_kwargs: dict[str, object]) -> str:
    reply = await client.chat.completions.create(model="policy", messages=messages, extra_body=request_kwargs)
    text = reply.choices[0].message.content or ""
    messages.append({"role": "assistant", "content": text})
    return text


def _client(base_url: str, kwargs: dict[str, object]) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=f"{base_url}/v1", api_key=kwargs.get("api_key", "EMPTY"), max_retries=0)


async def with_sub_agent(*, base_url: str, prompt: list[dict[str, object]], request_kwargs: dict[str, object],
                         metadata: dict[str, object], **kwargs: object) -> dict[str, object]:
    """Main turn, the sub-agent's turn, then the main conversation again with the sub-agent's answer as a tool
    result: two leaves (main: two turns; sub-agent: one)."""
    async with _client(base_url, kwargs) as client:
        main = [{"role": "system", "content": "You delegate."}, *prompt]
        await _say(client, main, request_kwargs)
        sub = [{"role": "system", "content": "You are a sub-agent."},
               {"role": "user", "content": f"Work on: {prompt[-1]['content']}"}]
        found = await _say(client, sub, request_kwargs)
        main.append({"role": "tool", "content": found})
        await _say(client, main, request_kwargs)
    return {"agents": 2}


async def compacting(*, base_url: str, prompt: list[dict[str, object]], request_kwargs: dict[str, object],
                     metadata: dict[str, object], **kwargs: object) -> dict[str, object]:
    """Two turns, then the history compacted into a summary and two more turns: two leaves of two turns each."""
    async with _client(base_url, kwargs) as client:
        system = {"role": "system", "content": "You work step by step."}
        messages = [system, *prompt]
        said = [await _say(client, messages, request_kwargs)]
        messages.append({"role": "user", "content": "continue"})
        said.append(await _say(client, messages, request_kwargs))
        messages = [system, {"role": "user", "content": "Summary of the work so far: " + " / ".join(said)}]
        await _say(client, messages, request_kwargs)
        messages.append({"role": "user", "content": "continue"})
        await _say(client, messages, request_kwargs)
    return {"compactions": 1}
