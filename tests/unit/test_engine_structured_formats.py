"""The engine's Anthropic Messages and OpenAI Responses formats, without a server: tool calls read from a model's
text (Qwen/Hermes `<tool_call>` blocks), the bodies mapped onto the chat route's, and the replies and stream
events as the official SDKs' own types parse them. Against a real engine: tests/integration/test_engine_openai.py."""

from __future__ import annotations

import json
from typing import Any

import anthropic.types
import openai.types.responses
import pydantic
import pytest

from workers.engine.anthropic_protocol import messages_request
from workers.engine.anthropic_replies import message, stop_reason
from workers.engine.finished_turns import Turn
from workers.engine.openai_protocol import chat_request
from workers.engine.responses_protocol import responses_request
from workers.engine.responses_replies import output, response_object
from workers.engine.responses_routes import ResponsesRoutes
from workers.engine.sampling_params import RequestError
from workers.engine.tool_call_text import ParsedCall, assistant_turn, sendable, split_tool_calls

ADD = {"add"}
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'


def turn(text: str = "", calls: list[ParsedCall] | None = None, finish: str = "stop", matched: Any = 0) -> Turn:
    return Turn("abc", text, calls or [], finish, matched, prompt_tokens=7, output_tokens=3, meta_info=None)


# ---- tool calls in text ------------------------------------------------------------------------------------


def test_calls_of_offered_tools_are_parsed_and_the_rest_stays_text() -> None:
    text = (
        "Let me add. " + CALL + '<tool_call>{"name": "rm", "arguments": {}}</tool_call>'
        '<tool_call>{not json}</tool_call><tool_call>{"name": "add", "arguments": "{\\"b\\": 2}"}</tool_call>'
    )
    normal, calls = split_tool_calls(text, ADD)
    assert normal == "Let me add. "
    assert calls == [ParsedCall("add", {"a": 1}), ParsedCall("add", {"b": 2})]
    # nothing parses as a call: every character stays text, none is lost
    for nothing in ('x <tool_call>{"name": "rm"}</tool_call>', "x <tool_call>{bad</tool_call>", "plain"):
        assert split_tool_calls(nothing, ADD) == (nothing, [])
    assert split_tool_calls(CALL, set()) == (CALL, [])  # no tools offered: no calls
    deep = "<tool_call>" + "[" * 100 + "]" * 100 + "</tool_call>"
    assert split_tool_calls(deep, ADD) == (deep, [])  # bounded decoding: a deep nest is not a call, not a crash


def test_a_call_the_prefill_opened_is_read_from_the_whole_turn() -> None:
    prefill = '<tool_call>{"name": "add", '
    text, calls = assistant_turn(prefill, '"arguments": {"a": 1}}</tool_call>', ADD)
    assert (text, calls) == ("", [ParsedCall("add", {"a": 1})])
    assert assistant_turn("The answer", " is 5", ADD) == (" is 5", [])
    assert assistant_turn("Sure. ", "Calling. " + CALL, ADD) == ("Calling. ", [ParsedCall("add", {"a": 1})])


def test_a_stream_holds_back_what_may_become_call_markup() -> None:
    assert sendable("", "hello <tool", ADD) == len("hello ")
    assert sendable("", "hello <tool_call>{", ADD) == len("hello ")
    assert sendable("", "a < b", ADD) == len("a < b")
    assert sendable("", "hello <tool", set()) == len("hello <tool")  # no tools: nothing held back
    assert sendable("<tool_", "call>", ADD) == 0
    # a stop string the engine will trim at the end is not sent first
    assert sendable("", "one\n", set(), ["\n\n"]) == len("one")
    assert sendable("", "one\n\ntwo", set(), ["\n\n"]) == len("one")
    assert sendable("\n\n", "one", set(), ["\n\n"]) == len("one")  # stops are matched in the output only
    assert sendable("", "x <tool_call> END", ADD, ["END"]) == len("x ")


# ---- Anthropic Messages --------------------------------------------------------------------------------------


def test_messages_map_onto_the_chat_body() -> None:
    use = {"type": "tool_use", "id": "toolu_1", "name": "add", "input": {"a": 1}}
    result = {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "5"}]}
    spec = messages_request(
        {
            "model": "claude",
            "max_tokens": 9,
            "system": [{"type": "text", "text": "Be"}, {"type": "text", "text": "brief."}],
            "messages": [
                {"role": "user", "content": "2+3="},
                {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": "s"}, use]},
                {"role": "user", "content": [result, {"type": "text", "text": "and now?"}]},
                {"role": "assistant", "content": "It is"},
            ],
            "tools": [{"name": "add", "input_schema": {"type": "object"}}],
            "stop_sequences": ["\n\n"],
            "top_k": 4,
            "seed": 2,
            "metadata": {"user_id": "u"},  # Anthropic fields the engine has no use for are ignored
        },
        "model-dir",
    )
    chat = spec.chat_body
    assert chat["messages"] == [
        {"role": "system", "content": "Be\nbrief."},
        {"role": "user", "content": "2+3="},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "toolu_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "5"},
        {"role": "user", "content": "and now?"},
        {"role": "assistant", "content": "It is"},
    ]
    assert chat["tools"] == [
        {"type": "function", "function": {"name": "add", "description": "", "parameters": {"type": "object"}}}
    ]
    assert chat["continue_final_message"] is True and spec.prefill == "It is"
    assert (chat["max_tokens"], chat["stop"], chat["top_k"], chat["seed"]) == (9, ["\n\n"], 4, 2)
    assert spec.tool_names == ADD and spec.model == "claude"
    generate = chat_request(chat, "model-dir")  # the chat route accepts what the mapping builds
    assert generate.body["sampling_params"]["max_new_tokens"] == 9
    assert generate.template_kwargs["continue_final_message"] is True
    none = messages_request(
        {"max_tokens": 1, "messages": [{"role": "user", "content": "x"}], "tools": [{"name": "add"}],
         "tool_choice": {"type": "none"}},
        "m",
    )
    assert none.tool_names == set() and none.chat_body["tool_choice"] == "none"


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ({"messages": [{"role": "user", "content": "x"}]}, "'max_tokens' is required"),
        ({"max_tokens": 1, "messages": "x"}, "'messages'"),
        ([1, 2], "JSON object"),
        ({"max_tokens": 1, "messages": [{"role": "assistant", "content": [{"type": "tool_use", "name": "f",
          "input": [1]}]}]}, "an object 'input'"),
        ({"max_tokens": 1, "messages": [{"role": "system", "content": "x"}]}, "role"),
        ({"max_tokens": 1, "messages": [{"role": "user", "content": [{"type": "document"}]}]}, "'document'"),
        ({"max_tokens": 1, "messages": [{"role": "assistant", "content": [{"type": "tool_result"}]}]}, "tool_result"),
        ({"max_tokens": 1, "messages": [{"role": "user", "content": "x"}], "system": 3}, "'system'"),
        ({"max_tokens": 1, "messages": [{"role": "user", "content": "x"}], "stop_sequences": [""]}, "stop_sequences"),
        ({"max_tokens": 1, "messages": [{"role": "user", "content": "x"}], "stream": True, "return_meta_info": True},
         "streaming"),
        ({"max_tokens": 1, "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "web_search_20250305",
          "name": "web_search"}]}, "server tools"),
        ({"max_tokens": 1, "messages": [{"role": "user", "content": "x"}], "tool_choice": {"type": "tool",
          "name": "add"}}, "constrained decoding"),
    ],
)
def test_bad_messages_bodies_name_the_field(body: Any, words: str) -> None:
    with pytest.raises(RequestError, match=words):
        messages_request(body, "m")


def test_stop_reasons_and_the_message_as_the_sdk_parses_it() -> None:
    spec = messages_request(
        {"max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "stop_sequences": ["END"]}, "m"
    )
    assert stop_reason(turn(matched=151643), spec) == ("end_turn", None)  # EOS: a token id
    assert stop_reason(turn(matched="END"), spec) == ("stop_sequence", "END")
    assert stop_reason(turn(matched="<|im_end|>"), spec) == ("end_turn", None)  # a stop the client did not ask
    assert stop_reason(turn(finish="length"), spec) == ("max_tokens", None)
    calls = [ParsedCall("add", {"a": 1})]
    assert stop_reason(turn(calls=calls, finish="length"), spec) == ("tool_use", None)
    parsed = anthropic.types.Message.model_validate(message(turn("Adding.", calls), spec))
    assert [block.type for block in parsed.content] == ["text", "tool_use"]
    assert parsed.content[1].input == {"a": 1} and parsed.content[1].id.startswith("toolu_")
    assert parsed.stop_reason == "tool_use" and parsed.usage.input_tokens == 7 and parsed.usage.output_tokens == 3


# ---- OpenAI Responses ----------------------------------------------------------------------------------------


def test_responses_input_maps_onto_the_chat_body() -> None:
    spec = responses_request(
        {
            "model": "gpt",
            "instructions": "Be brief.",
            "input": [
                {"role": "developer", "content": "Use tools."},
                {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "2+3="}]},
                {"type": "reasoning", "id": "rs_1", "summary": []},
                {"role": "assistant", "content": [{"type": "output_text", "text": "Adding.", "annotations": []}]},
                {"type": "function_call", "call_id": "c1", "name": "add", "arguments": '{"a": 2}'},
                {"type": "function_call", "call_id": "c2", "name": "add", "arguments": '{"a": 3}'},
                {"type": "function_call_output", "call_id": "c1", "output": "5"},
                {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "6"}]},
            ],
            "tools": [{"type": "function", "name": "add", "parameters": {"type": "object"}, "strict": True}],
            "max_output_tokens": 11,
            "store": True,
        },
        "model-dir",
    )
    chat = spec.chat_body
    assert chat["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "2+3="},
        {"role": "assistant", "content": "Adding.", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2}'}},
            {"id": "c2", "type": "function", "function": {"name": "add", "arguments": '{"a": 3}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "5"},
        {"role": "tool", "tool_call_id": "c2", "content": "6"},
    ]
    assert chat["max_tokens"] == 11 and spec.tool_names == ADD and spec.model == "gpt"
    assert chat_request(chat, "model-dir").template_kwargs["tools"][0]["name"] == "add"
    assert responses_request({"input": "hi"}, "m").chat_body["messages"] == [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ({"input": "x", "conversation": "conv_1"}, "stores no responses"),
        ({"input": "x", "tool_choice": "required"}, "constrained decoding"),
        ({"input": "x", "text": {"format": {"type": "json_object"}}}, "constrained decoding"),
        ({"input": [{"role": "tool", "content": "x"}]}, "role"),
        ({"input": [{"type": "function_call", "name": "add"}]}, "function_call"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]}, "input_image"),
        ({"input": "x", "stream": "yes"}, "booleans"),
        ("x", "JSON object"),
    ],
)
def test_bad_responses_bodies_name_the_field(body: Any, words: str) -> None:
    with pytest.raises(RequestError, match=words):
        responses_request(body, "m")


def test_the_response_as_the_sdk_parses_it() -> None:
    spec = responses_request({"input": "x", "tools": [{"type": "function", "name": "add"}]}, "m")
    done = turn("Adding.", [ParsedCall("add", {"a": 1})], finish="stop")
    parsed = openai.types.responses.Response.model_validate(response_object(spec, "resp_1", 0, done, output(done)))
    assert parsed.status == "completed" and parsed.output_text == "Adding."
    call = parsed.output[1]
    assert call.type == "function_call" and call.name == "add" and json.loads(call.arguments) == {"a": 1}
    assert parsed.usage.total_tokens == 10
    cut = turn("Add", finish="length")
    parsed = openai.types.responses.Response.model_validate(response_object(spec, "resp_2", 0, cut, output(cut)))
    assert parsed.status == "incomplete" and parsed.incomplete_details.reason == "max_output_tokens"


class ScriptedTurns:
    """FAKE of the turn runner: the tiny model cannot be made to write a tool call by itself, so this plays a turn
    that streams text and then ends in a call, to check the events of a streamed call."""

    def __init__(self, items: list[Any]) -> None:
        self.items = items
        self.aborted = False

    async def deltas(self, _started: Any) -> Any:
        for item in self.items:
            yield item

    def abort(self, _started: Any) -> None:
        self.aborted = True


@pytest.mark.anyio
async def test_a_streamed_call_as_the_sdk_parses_its_events() -> None:
    spec = responses_request({"input": "x", "tools": [{"type": "function", "name": "add"}], "stream": True}, "m")
    done = turn("Adding.", [ParsedCall("add", {"a": 1})])
    routes = ResponsesRoutes.__new__(ResponsesRoutes)
    routes.turns = ScriptedTurns(["Add", "ing.", done])  # type: ignore[assignment]
    started = type("S", (), {"seq": type("Q", (), {"public_id": "abc"})()})()
    raw = [chunk async for chunk in routes._events(spec, started, "resp_1", 0)]  # type: ignore[arg-type]
    adapter = pydantic.TypeAdapter(openai.types.responses.ResponseStreamEvent)
    events = [adapter.validate_python(json.loads(chunk.split("data: ", 1)[1])) for chunk in raw]
    assert [chunk.split("\n", 1)[0] for chunk in raw] == [f"event: {e.type}" for e in events]
    assert [e.type for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.output_item.added",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.completed",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    assert final.output_text == "Adding." and final.output[1].name == "add" and routes.turns.aborted
