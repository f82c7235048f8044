"""What rayless parses out of a reply's content is bounded too: a tool call the model (or a hostile engine) writes
nested 100k deep is skipped like any call that is not JSON, never a RecursionError (miles' multi-turn tool-call
parser, and the session server's matching of tool-call arguments)."""

from __future__ import annotations

import json

from coordinator.hooks.tool_calls import parse_tool_calls
from coordinator.sessions.tito import strict_matches

SPECS = [{"type": "function", "function": {"name": "calculator", "parameters": {}}}]
DEEP = "[" * 100_000 + "]" * 100_000


def test_a_deeply_nested_tool_call_is_skipped_and_the_good_one_kept() -> None:
    text = (f"<tool_call>{DEEP}</tool_call>"
            f'<tool_call>{{"name": "calculator", "arguments": {json.dumps(DEEP)}}}</tool_call>'
            '<tool_call>{"name": "calculator", "arguments": {"expression": "3+4"}}</tool_call>')
    calls = parse_tool_calls(text, SPECS, "qwen25")
    assert [(c.name, c.arguments) for c in calls] == [("calculator", {"expression": "3+4"})]


def test_deeply_nested_tool_call_arguments_compare_as_their_text() -> None:
    call = {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "calculator", "arguments": DEEP}}]}
    assert strict_matches(call, json.loads(json.dumps(call)))
    other = {**call, "tool_calls": [{"type": "function", "function": {"name": "calculator", "arguments": "[]"}}]}
    assert not strict_matches(call, other)
