"""The calculator agent of `examples/openai_agent`, written only against the official `anthropic` SDK (no rayless
import): it talks to the policy through the session server's `/v1/messages`, as a Claude-style harness does.

The task: a prompt `3+4` (sum below 10). The model's turn ends at its first digit or `=` (`stop_sequences`;
Messages reports which one in `stop_sequence`). A digit is its answer; `=` calls the calculator, whose result
comes back as a `tool_result` block, and the model answers in a second turn. Reward 1.0 when the answer is the
sum. The session server records exactly the tokens the model wrote; the tool's result is context (mask 0).

    PYTHONPATH=. rayless train --hf-checkpoint runs/tiny-model --config examples/harness_agents/messages.yaml
"""

from __future__ import annotations

from anthropic import AsyncAnthropic, DefaultAsyncHttpxClient

# the task's parts, shared with the chat-completions agent (its reward too: the config names it here)
from examples.openai_agent.agent import CALL, DIGITS, calculator, pooled_client, reward

#: request_kwargs (the rollout's sampling params, chat names) a Messages body carries as SGLang reads them
_SAMPLING = ("temperature", "top_p", "top_k", "seed")


async def _turn(client: AsyncAnthropic, messages: list[dict[str, object]], request_kwargs: dict[str, object]) -> str:
    """One model turn; returns the stop it ended on (a digit or '='), or '' when it ran out of tokens."""
    extra = {key: request_kwargs[key] for key in _SAMPLING if key in request_kwargs}
    reply = await client.messages.create(model="policy", max_tokens=int(request_kwargs.get("max_tokens", 3)),
                                         messages=messages, stop_sequences=[*DIGITS, CALL], extra_body=extra)
    text = "".join(block.text for block in reply.content if block.type == "text")
    messages.append({"role": "assistant", "content": text})
    return reply.stop_sequence or "" if reply.stop_reason == "stop_sequence" else ""


async def run_agent(*, base_url: str, prompt: list[dict[str, object]], request_kwargs: dict[str, object],
                    metadata: dict[str, object], **kwargs: object) -> dict[str, object]:
    """miles' agent contract: keyword arguments, the returned dict merged into the sample's metadata."""
    messages: list[dict[str, object]] = [{"role": "user", "content": prompt[-1]["content"]}]
    expression = prompt[-1]["content"]
    client = AsyncAnthropic(base_url=base_url, auth_token=kwargs.get("api_key", "EMPTY"), max_retries=0,
                            timeout=600, http_client=pooled_client(DefaultAsyncHttpxClient))
    ended = await _turn(client, messages, request_kwargs)
    called = ended == CALL
    if called:
        messages.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "calculator", "content": calculator(expression)}]})
        ended = await _turn(client, messages, request_kwargs)
    answer = ended if ended in DIGITS else ""
    return {"reward": float(answer == calculator(expression)), "tool_calls": int(called), "answer": answer}


__all__ = ["reward", "run_agent"]
