"""The session server's Messages and Responses formats without a server: a chat reply whose text holds a
Qwen/Hermes tool call becomes a `tool_use` block / `function_call` item as the official SDKs parse them, streamed
or whole; the assistant message the session stores is the one the client's next request maps back to (so a
harness that sends its history back continues the same branch); prefills are refused."""

from __future__ import annotations

import json
from typing import Any

import anthropic.types
import openai.types.responses
import pydantic
import pytest

from coordinator.sessions.tito import strict_matches
from coordinator.sessions.wire_formats import (
    FormatError,
    finished_turn,
    messages_call,
    responses_call,
    stored_reply,
)
from workers.engine.anthropic_protocol import messages_request
from workers.engine.responses_protocol import responses_request

CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'


def chat_reply(content: str, finish: str = "stop") -> dict[str, Any]:
    return {"id": "chat1", "choices": [{"index": 0, "message": {"role": "assistant", "content": content},
                                        "finish_reason": finish, "matched_stop": None,
                                        "meta_info": {"output_token_logprobs": [[-0.5, 7, None]]}}],
            "usage": {"prompt_tokens": 9, "completion_tokens": 4}}


def events(raw: list[str]) -> list[dict[str, Any]]:
    return [json.loads(chunk.split("data: ", 1)[1]) for chunk in raw]


async def test_a_tool_call_round_trips_through_messages() -> None:
    body = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "1+2"}],
            "tools": [{"name": "add", "input_schema": {"type": "object"}}]}
    call = messages_call(body, "m")
    assert "stream" not in call.chat_body and call.tool_names == {"add"}
    turn = finished_turn(chat_reply("Adding. " + CALL), call.tool_names, meta_info=call.meta_info)
    reply = anthropic.types.Message.model_validate_json(call.answer(turn))
    assert reply.stop_reason == "tool_use" and reply.content[1].input == {"a": 1, "b": 2}
    streamed = events([e async for e in messages_call({**body, "stream": True}, "m").events(turn)])
    adapter = pydantic.TypeAdapter(anthropic.types.RawMessageStreamEvent)
    parsed = [adapter.validate_python(e) for e in streamed]
    assert parsed[0].type == "message_start" and parsed[-1].type == "message_stop"
    assert [p.delta.text for p in parsed if p.type == "content_block_delta" and p.delta.type == "text_delta"] == [
        "Adding. "]
    # the client sends the reply back as its SDK dumped it: it maps to the message the session stored
    again = {**body, "messages": [*body["messages"], {"role": "assistant", "content": [
        block.model_dump() for block in reply.content]}, {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": reply.content[1].id, "content": "3"}]}]}
    mapped = messages_request(again, "m").chat_body["messages"]
    assert strict_matches(stored_reply(turn), mapped[1]) and mapped[2]["role"] == "tool"


async def test_a_tool_call_round_trips_through_responses() -> None:
    body = {"model": "m", "input": "1+2", "tools": [{"type": "function", "name": "add"}], "max_output_tokens": 8}
    call = responses_call(body, "m")
    turn = finished_turn(chat_reply(CALL), call.tool_names, meta_info=False)
    reply = openai.types.responses.Response.model_validate_json(call.answer(turn))
    (item,) = reply.output
    assert item.type == "function_call" and json.loads(item.arguments) == {"a": 1, "b": 2}
    adapter = pydantic.TypeAdapter(openai.types.responses.ResponseStreamEvent)
    streamed = [adapter.validate_python(e) for e in events(
        [e async for e in responses_call({**body, "stream": True}, "m").events(turn)])]
    assert streamed[-1].type == "response.completed" and streamed[-1].response.output[0].name == "add"
    again = {**body, "input": [{"role": "user", "content": "1+2"}, item.model_dump(exclude_none=True),
                               {"type": "function_call_output", "call_id": item.call_id, "output": "3"}]}
    mapped = responses_request(again, "m").chat_body["messages"]
    assert strict_matches(stored_reply(turn), mapped[1]) and mapped[2]["role"] == "tool"
    cut = finished_turn(chat_reply("12", finish="length"), set(), meta_info=False)
    assert json.loads(call.answer(cut))["status"] == "incomplete"


def test_a_prefill_and_bad_bodies_are_refused_naming_the_field() -> None:
    with pytest.raises(FormatError, match="prefill"):
        messages_call({"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "a"},
                                                                   {"role": "assistant", "content": "b"}]}, "m")
    with pytest.raises(FormatError, match="max_tokens"):
        messages_call({"model": "m", "messages": [{"role": "user", "content": "a"}]}, "m")
    with pytest.raises(FormatError, match="'input'"):
        responses_call({"model": "m", "input": []}, "m")


def test_image_blocks_and_input_image_parts_become_image_url_parts_in_order_on_a_vlm_session() -> None:
    """docs/vlm.md: a vision-language session takes Anthropic `image` blocks and Responses `input_image` parts as
    the OpenAI `image_url` parts its chat path reads; a text policy (and the engine's own routes) refuse them."""
    png = "data:image/png;base64,AAAA"
    image: anthropic.types.ImageBlockParam = {
        "type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}
    body = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "what colour?"}, image, {"type": "text", "text": "one word"}]}]}
    (message,) = messages_call(body, "m", images=True).chat_body["messages"]
    assert message == {"role": "user", "content": [
        {"type": "text", "text": "what colour?"}, {"type": "image_url", "image_url": {"url": png}},
        {"type": "text", "text": "one word"}]}
    linked = {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}
    (message,) = messages_call({**body, "messages": [{"role": "user", "content": [linked]}]}, "m",
                               images=True).chat_body["messages"]
    assert message["content"] == [{"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]
    # a tool's screenshot: the tool_result's image becomes a part of its tool message, as SGLang's adapter does
    shot = {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "shot:"}, {
        "type": "image", "source": {"type": "base64", "data": "AAAA"}}]}  # no media_type: SGLang's image/png
    (tool,) = messages_call({**body, "messages": [{"role": "user", "content": [shot]}]}, "m",
                            images=True).chat_body["messages"]
    assert tool == {"role": "tool", "tool_call_id": "t1", "content": [
        {"type": "text", "text": "shot:"}, {"type": "image_url", "image_url": {"url": png}}]}
    with pytest.raises(FormatError, match="text block"):
        messages_call({**body, "messages": [{"role": "user", "content": [shot]}]}, "m")
    filed = {"type": "image", "source": {"type": "file", "file_id": "file_1"}}
    with pytest.raises(FormatError, match="source of type base64"):
        messages_call({**body, "messages": [{"role": "user", "content": [filed]}]}, "m", images=True)
    with pytest.raises(FormatError, match="image"):
        messages_call(body, "m")
    assert messages_call({**body, "messages": [{"role": "user", "content": "hi"}]}, "m",
                         images=True).chat_body["messages"] == [{"role": "user", "content": "hi"}]

    parts = [{"type": "input_text", "text": "what colour?"}, {"type": "input_image", "image_url": png, "detail": "auto"}]
    asked = {"model": "m", "input": [{"role": "user", "content": parts}]}
    (message,) = responses_call(asked, "m", images=True).chat_body["messages"]
    assert message == {"role": "user", "content": [
        {"type": "text", "text": "what colour?"}, {"type": "image_url", "image_url": {"url": png}}]}
    as_object = [{"type": "input_image", "image_url": {"url": png}}]  # SGLang takes {"url": ...} too
    (message,) = responses_call({"model": "m", "input": [{"role": "user", "content": as_object}]}, "m",
                                images=True).chat_body["messages"]
    assert message["content"] == [{"type": "image_url", "image_url": {"url": png}}]
    with pytest.raises(FormatError, match="file_id"):
        responses_call({"model": "m", "input": [{"role": "user", "content": [
            {"type": "input_image", "file_id": "file_1", "detail": "auto"}]}]}, "m", images=True)
    with pytest.raises(FormatError, match="input_image"):
        responses_call(asked, "m")
