"""Tool calls in a model's text, as SGLang's function-call parsers read them, and tool results as chat tokens.

Owns the parsers of the `--generate-tool-call-parser` values rayless implements: `qwen25` and `hermes`, which write
each call as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`), `parse_tool_calls`, and
`tokenize_tool_responses` (miles' rule: the tokens a chat template adds for the tool messages after an
assistant turn, taken as the difference of two renderings, so they append to the token list as they are).

Invariants: a call naming a tool that is not in the specs, or whose JSON does not parse, is skipped (as
SGLang's parser does), never executed; the tool tokens are exactly a suffix of the template's rendering, or
`ToolCallError` says the template cannot be appended to.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from coordinator.config.hooks import TOOL_CALL_PARSERS
from workers.boundary.json_input import decode_json

#: `--generate-tool-call-parser` values: both write `<tool_call>` JSON blocks (SGLang's Qwen2.5 / Hermes).
PARSERS = TOOL_CALL_PARSERS
_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_DUMMY_USER = {"role": "user", "content": "dummy"}


class ToolCallError(ValueError):
    """A tool call or tool response that cannot be handled as asked."""


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


def tool_names(specs: list[dict[str, Any]]) -> set[str]:
    return {spec["function"]["name"] for spec in specs}


SOURCE = "tool call in the engine's reply"


def parse_tool_calls(text: str, specs: list[dict[str, Any]], parser: str) -> list[ToolCall]:
    """The calls of known tools in `text`, in order."""
    if parser not in PARSERS:
        raise ToolCallError(f"--generate-tool-call-parser {parser!r}: rayless implements {', '.join(PARSERS)}")
    known = tool_names(specs)
    calls = []
    for block in _BLOCK.findall(text):
        try:
            data = decode_json(block, SOURCE)  # model output: bounded (a deep nest is refused)
        except ValueError:
            continue
        if not isinstance(data, dict) or data.get("name") not in known:
            continue
        arguments = data.get("arguments", data.get("parameters", {}))
        if isinstance(arguments, str):
            try:
                arguments = decode_json(arguments, SOURCE)
            except ValueError:
                continue
        if isinstance(arguments, dict):
            calls.append(ToolCall(name=data["name"], arguments=arguments))
    return calls


def _token_ids(rendered: Any) -> list[int]:
    ids = rendered.get("input_ids") if isinstance(rendered, dict) or hasattr(rendered, "keys") else rendered
    return [int(token) for token in ids]


def tokenize_tool_responses(messages: list[dict[str, Any]], tokenizer: Any) -> list[int]:
    """The token ids the chat template adds for `messages` (role `tool`) after an assistant turn, with the
    next assistant turn's opening (miles' `tokenize_tool_responses`)."""
    assistant = {"role": "assistant", "content": "", "tool_calls": [
        {"id": message.get("tool_call_id", f"call{i}"), "type": "function",
         "function": {"name": message.get("name", "tool"), "arguments": {}}}
        for i, message in enumerate(messages)]}
    base = [_DUMMY_USER, assistant]
    with_tools = _token_ids(tokenizer.apply_chat_template(base + messages, tokenize=True,
                                                          add_generation_prompt=True, return_dict=False))
    without = _token_ids(tokenizer.apply_chat_template(base, tokenize=True, add_generation_prompt=False,
                                                       return_dict=False))
    if with_tools[: len(without)] != without:
        raise ToolCallError("the chat template renders the conversation differently once tool messages follow "
                            "(a thinking template?), so tool output cannot be appended token by token")
    return with_tools[len(without):]
