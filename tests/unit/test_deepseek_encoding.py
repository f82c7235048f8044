"""miles' `--tito-model deepseekv32` / `deepseekv4`: a multi-turn tool conversation encoded to the exact text
DeepSeek's encoders write (the expected strings below are written out from their rules: miles' vendored
`encoding_dsv32` and SGLang's `encoding_dsv4`, both with `drop_thinking=False`, as miles pins), and the session
server's token-in-token-out turns reproducing those ids on a real tokenizer that has DeepSeek's special tokens."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from coordinator.sessions.deepseek_encoding import DeepSeekEncodingError, encode_v4, encode_v32, with_tools
from coordinator.sessions.tito import SessionRequestError, strict_matches, tito_tokenizer
from coordinator.sessions.trajectory import Session

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
SPECIALS = [BOS, EOS, "<｜User｜>", "<｜Assistant｜>", "<think>", "</think>"]

TOOLS = [{"type": "function", "function": {
    "name": "add", "description": "add two integers",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}]
CALLS = [
    {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}},
    {"id": "call_2", "type": "function", "function": {"name": "add", "arguments": {"a": 4, "b": 5, "why": "check"}}},
]
#: system, user, an assistant calling two tools, their results (the second call's first), the answer, a user
CONVERSATION: list[dict[str, Any]] = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2+3 and 4+5?"},
    {"role": "assistant", "content": "", "reasoning_content": "use the tool", "tool_calls": CALLS},
    {"role": "tool", "tool_call_id": "call_2", "content": "9"},
    {"role": "tool", "tool_call_id": "call_1", "content": "5"},
    {"role": "assistant", "content": "5 and 9", "reasoning_content": "done"},
    {"role": "user", "content": "Thanks"},
]

SCHEMA = ('{"name": "add", "description": "add two integers", "parameters": {"type": "object", "properties": '
          '{"a": {"type": "integer"}, "b": {"type": "integer"}}}}')
V32_TOOLS = f"""## Tools
You have access to a set of tools you can use to answer the user's question.
You can invoke functions by writing a "<｜DSML｜function_calls>" block like the following as part of your reply to the user:
<｜DSML｜function_calls>
<｜DSML｜invoke name="$FUNCTION_NAME">
<｜DSML｜parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</｜DSML｜parameter>
...
</｜DSML｜invoke>
<｜DSML｜invoke name="$FUNCTION_NAME2">
...
</｜DSML｜invoke>
</｜DSML｜function_calls>
String and scalar parameters should be specified as is without any escaping or quotes, while lists and objects should use JSON format. The "string" attribute should be set to "true" for string type parameters and "false" for other types (numbers, booleans, arrays, objects).
If the thinking_mode is enabled, then after function results you should strongly consider outputting a thinking block. Here is an example:
<｜DSML｜function_calls>
...
</｜DSML｜function_calls>
<function_results>
...
</function_results>
<think>...thinking about results</think>
Here are the functions available in JSONSchema format:
<functions>
{SCHEMA}
</functions>
"""
V4_TOOLS = f"""## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools by writing a "<｜DSML｜tool_calls>" block like the following:

<｜DSML｜tool_calls>
<｜DSML｜invoke name="$TOOL_NAME">
<｜DSML｜parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</｜DSML｜parameter>
...
</｜DSML｜invoke>
<｜DSML｜invoke name="$TOOL_NAME2">
...
</｜DSML｜invoke>
</｜DSML｜tool_calls>

String parameters should be specified as is and set `string="true"`. For all other types (numbers, booleans, arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by <think>), you MUST output your complete reasoning inside <think>...</think> BEFORE any tool calls or final response.

Otherwise, output directly after </think> with tool calls or final response.

### Available Tool Schemas

{SCHEMA}

You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.
"""
INVOKES = ('<｜DSML｜invoke name="add">\n'
           '<｜DSML｜parameter name="a" string="false">2</｜DSML｜parameter>\n'
           '<｜DSML｜parameter name="b" string="false">3</｜DSML｜parameter>\n'
           '</｜DSML｜invoke>\n'
           '<｜DSML｜invoke name="add">\n'
           '<｜DSML｜parameter name="a" string="false">4</｜DSML｜parameter>\n'
           '<｜DSML｜parameter name="b" string="false">5</｜DSML｜parameter>\n'
           '<｜DSML｜parameter name="why" string="true">check</｜DSML｜parameter>\n'
           '</｜DSML｜invoke>')

#: each family's text, turn by turn: the first prompt, the first reply, what the tool results append, the second
#: reply, what the user's thanks appends
V32_PARTS = (
    f"{BOS}Be brief.\n\n{V32_TOOLS}<｜User｜>What is 2+3 and 4+5?<｜Assistant｜><think>",
    f"use the tool</think>\n\n<｜DSML｜function_calls>\n{INVOKES}\n</｜DSML｜function_calls>{EOS}",
    "\n\n<function_results>\n<result>9</result>\n<result>5</result>\n</function_results>\n\n<think>",
    f"done</think>5 and 9{EOS}",
    "<｜User｜>Thanks<｜Assistant｜><think>",
)
V4_PARTS = (
    f"{BOS}Be brief.\n\n{V4_TOOLS}<｜User｜>What is 2+3 and 4+5?<｜Assistant｜><think>",
    f"use the tool</think>\n\n<｜DSML｜tool_calls>\n{INVOKES}\n</｜DSML｜tool_calls>{EOS}",
    # results folded into one user turn, in the order of the calls (call_1's first)
    "<｜User｜><tool_result>5</tool_result>\n\n<tool_result>9</tool_result><｜Assistant｜><think>",
    f"done</think>5 and 9{EOS}",
    "<｜User｜>Thanks<｜Assistant｜><think>",
)


def test_v32_encodes_the_tool_conversation_as_its_rules_write_it() -> None:
    messages = with_tools(CONVERSATION, TOOLS)
    assert encode_v32(messages, mode="thinking") == "".join(V32_PARTS)
    # without the generation prompt, a render ending at tool results leaves off "\n\n<think>"
    assert encode_v32(messages[:5], mode="thinking", add_generation_prompt=False) == "".join(V32_PARTS[:3])[:-9]
    # chat mode: `</think>` opens each answer and assistants carry no thinking block
    chat = encode_v32([*CONVERSATION[:2], {"role": "assistant", "content": "5"}], mode="chat")
    assert chat == f"{BOS}Be brief.<｜User｜>What is 2+3 and 4+5?<｜Assistant｜></think>5{EOS}"


def test_v4_folds_tool_results_into_a_user_turn_in_call_order() -> None:
    messages = with_tools(CONVERSATION, TOOLS)
    assert encode_v4(messages, mode="thinking") == "".join(V4_PARTS)
    assert encode_v4(messages[:5], mode="thinking", add_generation_prompt=False) == "".join(V4_PARTS[:3])[:-len(
        "<｜Assistant｜><think>")]
    # no system message: tools get an empty one; reasoning_effort max opens the prompt with its paragraph
    lone = encode_v4(with_tools([CONVERSATION[1]], TOOLS), mode="thinking", reasoning_effort="max")
    assert lone.startswith(f"{BOS}Reasoning Effort: Absolute maximum with no shortcuts permitted.\n")
    assert lone.endswith(f"unchecked.\n\n\n\n{V4_TOOLS}<｜User｜>What is 2+3 and 4+5?<｜Assistant｜><think>")
    # a non-JSON argument string is kept as {"arguments": ...} by V4 and refused by V3.2
    odd = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": "not json"}}]}]
    assert '<｜DSML｜parameter name="arguments" string="true">not json</｜DSML｜parameter>' in encode_v4(
        odd, mode="chat")
    with pytest.raises(DeepSeekEncodingError, match="arguments are not JSON"):
        encode_v32(odd, mode="chat")
    with pytest.raises(DeepSeekEncodingError, match="a tool result without a tool call"):
        encode_v32([{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"},
                    {"role": "tool", "content": "z"}], mode="chat")


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Any:
    """The tiny model's real tokenizer with DeepSeek's special tokens added (each one id, as in DeepSeek's)."""
    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    tok.add_special_tokens({"additional_special_tokens": SPECIALS})
    return tok


def _reply(message: dict[str, Any]) -> dict[str, Any]:
    return {key: json.loads(json.dumps(value)) for key, value in message.items()}


@pytest.mark.parametrize(("family", "parts"), [("deepseekv32", V32_PARTS), ("deepseekv4", V4_PARTS)])
def test_session_turns_reproduce_the_encoders_ids(tokenizer: Any, family: str, parts: tuple[str, ...]) -> None:
    """Three turns of a session: each prompt is the stored ids (the previous prompt and exactly the generated
    ids) plus the appended messages' suffix, and equals the ids of the whole conversation's encoding."""
    tito = tito_tokenizer(family, tokenizer)
    assert tito.chat_template_kwargs == {"drop_thinking": False, "thinking": True}
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    session = Session()
    ends = (2, 5, 7)  # the messages each request carries
    replies = (CONVERSATION[2], CONVERSATION[5], {"role": "assistant", "content": "ok", "reasoning_content": ""})
    outputs = (parts[1], parts[3], f"</think>ok{EOS}")
    previous: list[int] = []
    for turn, (end, reply, output) in enumerate(zip(ends, replies, outputs, strict=True)):
        prompt, kept = session.prompt_ids(CONVERSATION[:end], TOOLS, tito, strict_matches)
        assert prompt == encode("".join(parts[: 2 * turn + 1]))
        assert prompt[: len(previous)] == previous  # nothing earlier re-tokenised
        generated = encode(output)
        session.record(kept=kept, prompt_ids=prompt, messages=CONVERSATION[:end], reply=_reply(reply),
                       output_ids=generated, logprobs=[-0.5] * len(generated), finish="stop",
                       weight_version=str(turn), record={"request": {}})
        previous = prompt + generated


def test_the_families_pin_drop_thinking_read_the_mode_and_refuse_what_they_cannot_render(tokenizer: Any,
                                                                                       tiny_model_dir: Path) -> None:
    assert tito_tokenizer("deepseekv32", tokenizer, {"enable_thinking": False}).mode == "chat"
    assert tito_tokenizer("deepseekv4", tokenizer, {"thinking_mode": "chat", "thinking": True}).mode == "chat"
    with pytest.raises(ValueError, match="drop_thinking=True conflicts"):
        tito_tokenizer("deepseekv4", tokenizer, {"drop_thinking": True})
    with pytest.raises(ValueError, match="takes no chat template kwarg clear_thinking"):
        tito_tokenizer("deepseekv32", tokenizer, {"clear_thinking": False})
    with pytest.raises(ValueError, match="takes no chat template kwarg reasoning_effort"):
        tito_tokenizer("deepseekv32", tokenizer, {"reasoning_effort": "max"})  # V4's only
    with pytest.raises(ValueError, match="no single token '<｜User｜>'"):
        tito_tokenizer("deepseekv4", AutoTokenizer.from_pretrained(str(tiny_model_dir)))  # not DeepSeek's
    v4 = tito_tokenizer("deepseekv4", tokenizer)
    session = Session()
    prompt, kept = session.prompt_ids(CONVERSATION[:2], None, v4, strict_matches)
    output = tokenizer.encode(f"</think>5{EOS}", add_special_tokens=False)
    session.record(kept=kept, prompt_ids=prompt, messages=CONVERSATION[:2], reply={"role": "assistant", "content": "5"},
                   output_ids=output, logprobs=[0.0] * len(output), finish="stop", weight_version="0",
                   record={"request": {}})
    with pytest.raises(SessionRequestError, match=r"\['tool', 'user'\] \(--tito-model deepseekv4\), got 'system'"):
        session.prompt_ids([*CONVERSATION[:2], {"role": "assistant", "content": "5"},
                            {"role": "system", "content": "x"}], None, v4, strict_matches)
    with pytest.raises(SessionRequestError, match=r"DeepSeek's encoder cannot render these messages.*no role"):
        v4.first_prompt([{"role": "narrator", "content": "x"}], None)
