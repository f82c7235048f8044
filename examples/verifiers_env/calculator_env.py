"""A multi-turn tool verifiers environment (`vf.MultiTurnEnv`) with its own dataset: a sum `3+4` to answer,
with a calculator tool. The model's turn ends at its first digit or `=` (a stop regex: SGLang keeps a regex
match in the content, where it trims a stop string).
A digit is its answer; `=` calls the tool `add`, whose result comes back as a `tool` message, and the model
answers in a second turn. Reward 1.0 when the answer is the sum; the rubric also counts tool calls.

The tool call is written in text, not as an OpenAI `tool_calls` field: rayless' engine, like SGLang without a
`--tool-call-parser`, leaves tool calls in the text. The sum is in the context only after a call, so the
policy learns to call, then to copy what the tool said.
"""

from __future__ import annotations

import re
from typing import Any

import verifiers as vf
from datasets import Dataset

from examples.verifiers_env.echo_env import _text, first_digit

CALL = "="  # the character that calls the tool (a regex; `load_environment(call=...)` widens it)


def add(a: int, b: int) -> int:
    """The calculator tool: the sum of two integers."""
    return a + b


def _last_assistant(messages: Any) -> str:
    return _text([message for message in messages if getattr(message, "role", None) == "assistant"][-1:])


class CalculatorEnv(vf.MultiTurnEnv):
    """Up to two model turns: an optional tool call, then the answer. A turn calls the tool when it ends on a
    character matching `call` (the stop regex ends the turn there and keeps the character)."""

    def __init__(self, call: str = CALL, **kwargs: Any) -> None:
        self.call = re.compile(call)
        super().__init__(max_turns=2, sampling_args={"stop_regex": [f"[0-9]|{call}"]}, **kwargs)

    def calls_tool(self, text: str) -> bool:
        return bool(text) and self.call.fullmatch(text[-1]) is not None

    @vf.stop
    async def answered(self, state: vf.State, **kwargs: Any) -> bool:
        """The rollout ends once the model's last turn did not call the tool."""
        trajectory = state["trajectory"]
        return bool(trajectory) and not self.calls_tool(_text(trajectory[-1]["completion"]))

    async def env_response(self, messages: vf.Messages, state: vf.State, **kwargs: Any) -> vf.Messages:
        left, right = state["answer_operands"]
        state["tool_calls"] = state.get("tool_calls", 0) + 1
        return [vf.ToolMessage(role="tool", content=str(add(left, right)), tool_call_id=f"add-{state['tool_calls']}")]

    async def setup_state(self, state: vf.State) -> vf.State:
        question = state["prompt"][-1].content
        state["answer_operands"] = tuple(int(part) for part in question.split("+"))
        return state


async def correct_sum(completion: Any, answer: str, **kwargs: Any) -> float:
    """1.0 when the last turn's first digit is the sum."""
    return float(first_digit(_last_assistant(completion)) == answer)


async def tool_calls(state: vf.State, **kwargs: Any) -> float:
    return float(state.get("tool_calls", 0))


def dataset() -> Dataset:
    rows = [{"question": f"{a}+{b}", "answer": str(a + b)} for a in range(10) for b in range(10) if a + b < 10]
    return Dataset.from_list(rows)


def load_environment(call: str = CALL, **kwargs: Any) -> vf.Environment:
    rubric = vf.Rubric(funcs=[correct_sum, tool_calls], weights=[1.0, 0.0])
    return CalculatorEnv(call=call, dataset=dataset(), rubric=rubric, **kwargs)
