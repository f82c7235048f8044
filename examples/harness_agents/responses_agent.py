"""The calculator agent of `examples/openai_agent`, written against the official `openai` SDK's Responses API
(`client.responses.create`): it talks to the policy through the session server's `/v1/responses`, as an
OpenAI-Agents-SDK- or Codex-style harness does.

The task: a prompt `3+4` (sum below 10). The model's turn ends at its first digit or `=` (SGLang's `stop` extra
of the Responses request; which one matched is in the reply's `meta_info`, SGLang's token-in/token-out
extension). A digit is its answer; `=` calls the calculator, whose result comes back as a `function_call_output`
item, and the model answers in a second turn. Reward 1.0 when the answer is the sum.

    PYTHONPATH=. rayless train --hf-checkpoint runs/tiny-model --config examples/harness_agents/responses.yaml
"""

from __future__ import annotations

from openai import AsyncOpenAI

# the task's parts, shared with the chat-completions agent (its reward too: the config names it here)
from examples.openai_agent.agent import CALL, DIGITS, calculator, pooled_client, reward

#: request_kwargs (the rollout's sampling params, chat names) a Responses body carries as SGLang reads them
_SAMPLING = ("temperature", "top_p", "top_k", "min_p", "seed", "repetition_penalty")


async def _turn(client: AsyncOpenAI, items: list[dict[str, object]], request_kwargs: dict[str, object]) -> str:
    """One model turn; returns the stop it ended on (a digit or '='), or '' when it ran out of tokens."""
    extra = {key: request_kwargs[key] for key in _SAMPLING if key in request_kwargs}
    reply = await client.responses.create(
        model="policy", input=items, max_output_tokens=int(request_kwargs.get("max_tokens", 3)),
        extra_body={**extra, "stop": [*DIGITS, CALL], "return_meta_info": True})
    items.append({"role": "assistant", "content": reply.output_text})
    finish = (reply.model_extra or {}).get("meta_info", {}).get("finish_reason") or {}
    matched = finish.get("matched") if finish.get("type") == "stop" else None
    return matched if isinstance(matched, str) else ""


async def run_agent(*, base_url: str, prompt: list[dict[str, object]], request_kwargs: dict[str, object],
                    metadata: dict[str, object], **kwargs: object) -> dict[str, object]:
    """miles' agent contract: keyword arguments, the returned dict merged into the sample's metadata."""
    items: list[dict[str, object]] = [{"role": "user", "content": prompt[-1]["content"]}]
    expression = prompt[-1]["content"]
    client = AsyncOpenAI(base_url=f"{base_url}/v1", api_key=kwargs.get("api_key", "EMPTY"), max_retries=0,
                         timeout=600, http_client=pooled_client())
    ended = await _turn(client, items, request_kwargs)
    called = ended == CALL
    if called:
        items.append({"type": "function_call_output", "call_id": "calculator", "output": calculator(expression)})
        ended = await _turn(client, items, request_kwargs)
    answer = ended if ended in DIGITS else ""
    return {"reward": float(answer == calculator(expression)), "tool_calls": int(called), "answer": answer}


__all__ = ["reward", "run_agent"]
