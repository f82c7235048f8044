"""The engine's OpenAI-compatible endpoints, driven by the official `openai` SDK against a real engine process.

What is checked is behaviour a client relies on: the chat prompt is the model's chat template (the same tokens
and logprobs as `/generate` on the template's ids), `input_ids` replace the messages, stops, seeds and `n` act
as in /generate, streams concatenate to the non-streamed answer, logprobs agree with
`meta_info.output_token_logprobs`, and errors are SGLang's 4xx `ErrorResponse` (401 without the API key). The
same engine serves Anthropic's `/v1/messages` (the official `anthropic` SDK) and OpenAI's `/v1/responses`: the
same tokens, counts and token-in/token-out fields as the chat route, tool calls parsed into blocks and tool
results rendered back, streams that assemble to the whole answer, errors in each format's shape.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
from transformers import AutoTokenizer

from tests.support.engine_proc import start_engine

API_KEY = "test-openai-key"
MESSAGES = [{"role": "system", "content": "Add."}, {"role": "user", "content": "2+3="}]


@pytest.fixture(scope="module")
def engine_url(tiny_model_dir: Path) -> Iterator[str]:
    with start_engine(tiny_model_dir, api_key=API_KEY, extra_args=["--max-request-bytes", "65536"]) as url:
        yield url


@pytest.fixture(scope="module")
def client(engine_url: str) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=engine_url + "/v1", api_key=API_KEY, max_retries=0, timeout=60) as sdk:
        yield sdk


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


def generate(engine_url: str, body: dict[str, Any]) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    response = httpx.post(engine_url + "/generate", json=body, headers=headers, timeout=60)
    response.raise_for_status()
    return response.json()


def template_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def test_models_lists_the_served_model(client: openai.OpenAI, tiny_model_dir: Path) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [str(tiny_model_dir)]
    assert models[0].model_extra["max_model_len"] > 0


def test_chat_renders_the_chat_template_and_matches_generate(
    client: openai.OpenAI, engine_url: str, tokenizer: Any
) -> None:
    reply = client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        max_tokens=6,
        seed=7,
        logprobs=True,
        top_logprobs=3,
        extra_body={"return_meta_info": True},
    )
    ids = template_ids(tokenizer, MESSAGES)
    same = generate(
        engine_url,
        {
            "input_ids": ids,
            "return_logprob": True,
            "sampling_params": {"max_new_tokens": 6, "sampling_seed": 7},
        },
    )
    choice = reply.choices[0]
    meta = choice.model_extra["meta_info"]
    assert [t[1] for t in meta["output_token_logprobs"]] == same["output_ids"]
    assert [t[0] for t in meta["output_token_logprobs"]] == pytest.approx(
        [t[0] for t in same["meta_info"]["output_token_logprobs"]], abs=1e-5
    )
    assert choice.message.content == same["text"]
    assert reply.usage.prompt_tokens == len(ids)
    assert reply.usage.completion_tokens == len(same["output_ids"]) == len(choice.logprobs.content)
    assert reply.usage.total_tokens == len(ids) + len(same["output_ids"])
    for entry, (logprob, token, _text) in zip(
        choice.logprobs.content, meta["output_token_logprobs"], strict=True
    ):
        assert entry.logprob == logprob
        assert entry.token == tokenizer.decode([token])
        assert len(entry.top_logprobs) == 3
        assert max(top.logprob for top in entry.top_logprobs) >= entry.logprob
    assert reply.model == "tiny" and reply.object == "chat.completion"


def test_chat_input_ids_replace_the_messages(client: openai.OpenAI, tokenizer: Any) -> None:
    ids = template_ids(tokenizer, MESSAGES)
    rendered = client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=5, seed=3)
    given = client.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "ignored"}],
        max_tokens=5,
        seed=3,
        extra_body={"input_ids": ids},
    )
    assert given.choices[0].message.content == rendered.choices[0].message.content
    assert given.usage.prompt_tokens == len(ids)


def test_chat_without_meta_info_has_no_meta_info(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=3)
    assert "meta_info" not in (reply.choices[0].model_extra or {})
    assert reply.choices[0].logprobs is None


def test_seed_n_and_max_tokens(client: openai.OpenAI) -> None:
    first = client.chat.completions.create(
        model="m", messages=MESSAGES, max_tokens=8, seed=11, n=3, extra_body={"ignore_eos": True}
    )
    again = client.chat.completions.create(
        model="m", messages=MESSAGES, max_tokens=8, seed=11, n=3, extra_body={"ignore_eos": True}
    )
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert [c.message.content for c in first.choices] == [c.message.content for c in again.choices]
    assert all(c.finish_reason == "length" for c in first.choices)
    assert first.usage.completion_tokens == 3 * 8
    assert len({c.message.content for c in first.choices}) > 1  # the n samples are not copies


def test_stop_strings_stop_token_ids_and_no_stop_trim(client: openai.OpenAI, tokenizer: Any) -> None:
    def chat(**extra: Any) -> Any:
        return client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=12, seed=5, **extra)

    base = chat()
    assert base.choices[0].finish_reason == "length"  # seed 5 writes 12 tokens: room for a stop inside
    text = base.choices[0].message.content
    stop = text[3]
    cut = chat(stop=[stop])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].model_extra["matched_stop"] == stop
    assert cut.choices[0].message.content == text[: text.index(stop)]
    kept = chat(stop=[stop], extra_body={"no_stop_trim": True})
    assert kept.choices[0].message.content == text[: text.index(stop) + 1]
    token = tokenizer.convert_tokens_to_ids(stop)
    by_id = chat(extra_body={"stop_token_ids": [token], "return_meta_info": True})
    assert by_id.choices[0].model_extra["matched_stop"] == token
    assert by_id.choices[0].message.content == text[: text.index(stop)]
    assert by_id.choices[0].model_extra["meta_info"]["completion_tokens"] == text.index(stop) + 1


def test_skip_special_tokens_false_keeps_eos_text(client: openai.OpenAI) -> None:
    ids_reply = client.chat.completions.create(
        model="m",
        messages=MESSAGES,
        max_tokens=40,
        seed=1,
        extra_body={"skip_special_tokens": False},
        logprobs=True,
    )
    choice = ids_reply.choices[0]
    if choice.finish_reason == "stop":  # ended on EOS: its text is kept only without skip_special_tokens
        assert choice.logprobs.content[-1].token == "<|endoftext|>"
    plain = client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=40, seed=1)
    assert "<|endoftext|>" not in plain.choices[0].message.content


def test_chat_stream_concatenates_to_the_answer(client: openai.OpenAI) -> None:
    whole = client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=10, seed=9, logprobs=True)
    stream = client.chat.completions.create(
        model="m",
        messages=MESSAGES,
        max_tokens=10,
        seed=9,
        logprobs=True,
        stream=True,
        stream_options={"include_usage": True},
    )
    text, logprobs, finish, usage = "", [], None, None
    for event in stream:
        assert event.object == "chat.completion.chunk"
        if event.usage is not None:
            usage = event.usage
        for choice in event.choices:
            text += choice.delta.content or ""
            logprobs += [e.logprob for e in (choice.logprobs.content if choice.logprobs else [])]
            finish = choice.finish_reason or finish
    assert text == whole.choices[0].message.content
    # Same tokens; the logprobs agree to float noise (the prefix cache can make the two prefills differ).
    assert logprobs == pytest.approx([e.logprob for e in whole.choices[0].logprobs.content], abs=1e-5)
    assert finish == whole.choices[0].finish_reason
    assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens


def test_completions_text_batch_n_logprobs_and_echo(client: openai.OpenAI, engine_url: str) -> None:
    reply = client.completions.create(
        model="m", prompt=["12", "ab"], max_tokens=4, n=2, seed=2, logprobs=2, extra_body={"ignore_eos": True}
    )
    assert [c.index for c in reply.choices] == [0, 1, 2, 3]
    assert reply.usage.prompt_tokens == 4 and reply.usage.completion_tokens == 16
    same = generate(
        engine_url,
        {
            "text": "12",
            "return_logprob": True,
            "sampling_params": {"max_new_tokens": 4, "sampling_seed": 2, "ignore_eos": True},
        },
    )
    assert reply.choices[0].text == same["text"]
    assert reply.choices[0].logprobs.token_logprobs == pytest.approx(  # batched with 3 others: float noise
        [t[0] for t in same["meta_info"]["output_token_logprobs"]], abs=1e-5
    )
    assert all(len(top) == 2 for top in reply.choices[0].logprobs.top_logprobs)
    echoed = client.completions.create(
        model="m", prompt="12", max_tokens=4, seed=2, echo=True, logprobs=0, extra_body={"ignore_eos": True}
    )
    assert echoed.choices[0].text == "12" + same["text"]
    assert echoed.choices[0].logprobs.tokens[:2] == ["1", "2"]
    assert echoed.choices[0].logprobs.token_logprobs[0] is None  # the first prompt token has no logprob
    by_ids = client.completions.create(model="m", prompt=[1 + 4, 1 + 5], max_tokens=2)
    assert by_ids.usage.prompt_tokens == 2


def test_completions_stream(client: openai.OpenAI) -> None:
    whole = client.completions.create(model="m", prompt="7*", max_tokens=6, seed=4)
    parts = [
        e.choices[0]
        for e in client.completions.create(model="m", prompt="7*", max_tokens=6, seed=4, stream=True)
    ]
    assert "".join(p.text for p in parts) == whole.choices[0].text
    assert parts[-1].finish_reason == whole.choices[0].finish_reason


# ---- the structured wire formats over the same core: Anthropic /v1/messages, OpenAI /v1/responses ----------

TOOLS = [{"name": "add", "description": "add two numbers", "input_schema": {"type": "object"}}]
# The tiny model cannot be made to write a call by itself; a prefilled assistant turn (which the model continues)
# holds one, so the engine's parser meets a real call in the turn's text.
CALL = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'


@pytest.fixture(scope="module")
def claude(engine_url: str) -> Iterator[anthropic.Anthropic]:
    # --api-key is the engine's Bearer key on every route: the SDK's auth_token.
    with anthropic.Anthropic(
        base_url=engine_url, auth_token=API_KEY, api_key=None, max_retries=0, timeout=60
    ) as sdk:
        yield sdk


def test_messages_are_the_chat_route_in_anthropic_shape(
    claude: anthropic.Anthropic, client: openai.OpenAI, tokenizer: Any
) -> None:
    sampling = {"temperature": 1.0, "seed": 5}
    user = [MESSAGES[1]]
    reply = claude.messages.create(
        model="tiny",
        system=MESSAGES[0]["content"],
        messages=user,
        max_tokens=12,
        extra_body={**sampling, "return_meta_info": True},
    )
    chat = client.chat.completions.create(
        model="m",
        messages=MESSAGES,
        max_tokens=12,
        logprobs=True,
        extra_body={**sampling, "return_meta_info": True},
    )
    ids = template_ids(tokenizer, MESSAGES)
    assert [block.type for block in reply.content] == ["text"]
    assert reply.content[0].text == chat.choices[0].message.content
    assert reply.stop_reason == "max_tokens" and reply.stop_sequence is None  # seed 5 writes 12 tokens
    assert reply.usage.input_tokens == len(ids) and reply.usage.output_tokens == 12
    # token in / token out, as the chat route records it
    mine, theirs = reply.model_extra["meta_info"], chat.choices[0].model_extra["meta_info"]
    assert [t[1] for t in mine["output_token_logprobs"]] == [t[1] for t in theirs["output_token_logprobs"]]
    assert [t[0] for t in mine["output_token_logprobs"]] == pytest.approx(
        [t[0] for t in theirs["output_token_logprobs"]], abs=1e-5
    )
    counted = claude.messages.count_tokens(model="tiny", system=MESSAGES[0]["content"], messages=user)
    assert counted.input_tokens == len(ids)

    with claude.messages.stream(
        model="tiny", system=MESSAGES[0]["content"], messages=user, max_tokens=12, extra_body=sampling
    ) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert {"content_block_start", "content_block_delta", "content_block_stop", "message_delta"} <= set(kinds)
    assert final.content[0].text == reply.content[0].text
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 12

    text = reply.content[0].text
    stop = text[3:5]  # two characters: the stream must not send the first before the second shows it a stop
    cut = claude.messages.create(
        model="tiny", system="Add.", messages=user, max_tokens=12, stop_sequences=[stop], extra_body=sampling
    )
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert cut.content[0].text == text[: text.index(stop)]
    with claude.messages.stream(
        model="tiny", system="Add.", messages=user, max_tokens=12, stop_sequences=[stop], extra_body=sampling
    ) as stream:
        deltas = "".join(event.delta.text for event in stream if event.type == "content_block_delta")
        streamed = stream.get_final_message()
    assert deltas == streamed.content[0].text == cut.content[0].text
    assert (streamed.stop_reason, streamed.stop_sequence) == ("stop_sequence", stop)


def test_messages_tool_use_round_trip(claude: anthropic.Anthropic, tokenizer: Any) -> None:
    asked = [{"role": "user", "content": "2+3="}, {"role": "assistant", "content": CALL}]
    reply = claude.messages.create(model="tiny", max_tokens=3, tools=TOOLS, messages=asked)
    assert reply.stop_reason == "tool_use"
    [use] = [block for block in reply.content if block.type == "tool_use"]
    assert use.name == "add" and use.input == {"a": 2, "b": 3}
    with claude.messages.stream(model="tiny", max_tokens=3, tools=TOOLS, messages=asked) as stream:
        streamed = stream.get_final_message()
    assert streamed.stop_reason == "tool_use"
    assert [(b.name, b.input) for b in streamed.content if b.type == "tool_use"] == [
        ("add", {"a": 2, "b": 3})
    ]
    # Without the tool offered, the same turn is text: nothing is parsed from a tool the request did not give.
    plain = claude.messages.create(model="tiny", max_tokens=3, messages=asked, extra_body={"seed": 1})
    assert plain.stop_reason != "tool_use" and all(b.type == "text" for b in plain.content)

    answered = [
        {"role": "user", "content": "2+3="},
        {"role": "assistant", "content": [use.model_dump(include={"type", "id", "name", "input"})]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "5"}]},
    ]
    # The tool result is rendered back as a `tool` message through the chat template.
    expected = [
        {"role": "user", "content": "2+3="},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": use.id,
                    "type": "function",
                    "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": use.id, "content": "5"},
    ]
    rendered = tokenizer.apply_chat_template(
        expected,
        tools=[{"name": "add", "description": "add two numbers", "parameters": {"type": "object"}}],
        tokenize=False,
        add_generation_prompt=True,
    )
    ids = tokenizer.encode(rendered, add_special_tokens=False)
    assert "<|im_start|>tool\n5<|im_end|>" in rendered
    assert claude.messages.count_tokens(model="tiny", tools=TOOLS, messages=answered).input_tokens == len(ids)
    after = claude.messages.create(model="tiny", max_tokens=4, tools=TOOLS, messages=answered)
    assert after.usage.input_tokens == len(ids)


def test_responses_are_the_chat_route_in_responses_shape(client: openai.OpenAI, tokenizer: Any) -> None:
    sampling = {"seed": 5}
    reply = client.responses.create(
        model="tiny",
        instructions="Add.",
        input="2+3=",
        max_output_tokens=12,
        temperature=1.0,
        extra_body={**sampling, "return_meta_info": True},
    )
    chat = client.chat.completions.create(
        model="m",
        messages=MESSAGES,
        max_tokens=12,
        temperature=1.0,
        logprobs=True,
        extra_body={**sampling, "return_meta_info": True},
    )
    ids = template_ids(tokenizer, MESSAGES)
    assert reply.output_text == chat.choices[0].message.content
    assert reply.status == "incomplete" and reply.incomplete_details.reason == "max_output_tokens"
    assert reply.usage.input_tokens == len(ids) and reply.usage.output_tokens == 12
    assert reply.usage.total_tokens == len(ids) + 12
    assert [t[1] for t in reply.model_extra["meta_info"]["output_token_logprobs"]] == [
        t[1] for t in chat.choices[0].model_extra["meta_info"]["output_token_logprobs"]
    ]
    # Cut by the length, the stream ends with `response.incomplete` (the SDK's `responses.stream` helper waits
    # for `response.completed` only, so the events are read as they come).
    events = list(
        client.responses.create(
            model="tiny",
            instructions="Add.",
            input="2+3=",
            max_output_tokens=12,
            temperature=1.0,
            stream=True,
            extra_body=sampling,
        )
    )
    kinds = [event.type for event in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.incomplete"
    assert [event.sequence_number for event in events] == list(range(len(events)))
    deltas = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    final = events[-1].response
    assert deltas == final.output_text == reply.output_text and final.usage.output_tokens == 12

    # A function call and its output in the input are rendered as the chat route renders tool calls and results.
    tools = [{"type": "function", "name": "add", "parameters": {"type": "object"}, "strict": False}]
    items = [
        {"role": "user", "content": "2+3="},
        {"type": "function_call", "call_id": "c1", "name": "add", "arguments": '{"a": 2}'},
        {"type": "function_call_output", "call_id": "c1", "output": "5"},
    ]
    answered = client.responses.create(model="tiny", input=items, tools=tools, max_output_tokens=2)
    expected = [
        {"role": "user", "content": "2+3="},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "5"},
    ]
    assert answered.usage.input_tokens == len(template_ids(tokenizer, expected))


@pytest.mark.parametrize(
    ("call", "words"),
    [
        (lambda c: c.messages.create(model="m", max_tokens=0, messages=MESSAGES[1:]), "max_tokens"),
        (lambda c: c.messages.create(model="m", max_tokens=2, messages=[]), "messages"),
        (
            lambda c: c.messages.create(
                model="m",
                max_tokens=2,
                messages=[
                    {
                        "role": "user",
                        "content": [{"type": "image", "source": {"type": "url", "url": "http://x"}}],
                    }
                ],
            ),
            "'image'",
        ),
        (
            lambda c: c.messages.create(
                model="m", max_tokens=2, messages=MESSAGES[1:], tools=TOOLS, tool_choice={"type": "any"}
            ),
            "constrained decoding",
        ),
        (lambda c: c.messages.create(model="m", max_tokens=100000, messages=MESSAGES[1:]), "context length"),
        (lambda c: c.messages.count_tokens(model="m", messages=[{"role": "robot", "content": "x"}]), "role"),
    ],
)
def test_bad_messages_are_anthropic_errors(claude: anthropic.Anthropic, call: Any, words: str) -> None:
    with pytest.raises(anthropic.BadRequestError) as caught:
        call(claude)
    assert caught.value.body["type"] == "error"
    assert caught.value.body["error"]["type"] == "invalid_request_error"
    assert words in caught.value.body["error"]["message"]


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ({"input": "x", "previous_response_id": "resp_1"}, "stores no responses"),
        ({"input": []}, "'input'"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "function tools"),
        ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": [{"type": "input_image", "image_url": "x"}]}, "input_image"),
    ],
)
def test_bad_responses_are_sglang_error_responses(
    client: openai.OpenAI, body: dict[str, Any], words: str
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model="m", **body)
    assert caught.value.body["object"] == "error" and caught.value.status_code == 400
    assert words in caught.value.body["message"]


def test_structured_routes_behind_the_api_key_and_body_limit(
    engine_url: str, claude: anthropic.Anthropic
) -> None:
    with anthropic.Anthropic(
        base_url=engine_url, auth_token="wrong", api_key=None, max_retries=0
    ) as stranger:
        with pytest.raises(anthropic.AuthenticationError):
            stranger.messages.create(model="m", max_tokens=1, messages=MESSAGES[1:])
        with pytest.raises(anthropic.AuthenticationError):
            stranger.messages.count_tokens(model="m", messages=MESSAGES[1:])
    # the SDK's own `api_key` goes as `x-api-key`: the key opens the Messages routes that way too
    with anthropic.Anthropic(base_url=engine_url, api_key=API_KEY, max_retries=0, timeout=60) as own_header:
        assert own_header.messages.count_tokens(model="m", messages=MESSAGES[1:]).input_tokens > 0
        assert own_header.messages.create(model="m", max_tokens=1, messages=MESSAGES[1:]).usage.output_tokens == 1
    with anthropic.Anthropic(base_url=engine_url, api_key="wrong", max_retries=0) as stranger:
        with pytest.raises(anthropic.AuthenticationError):
            stranger.messages.create(model="m", max_tokens=1, messages=MESSAGES[1:])
    # and no other route: elsewhere the key is SGLang's Bearer token only
    for path in ("/v1/models", "/model_info"):
        assert httpx.get(engine_url + path, headers={"x-api-key": API_KEY}).status_code == 401
    with openai.OpenAI(base_url=engine_url + "/v1", api_key="wrong", max_retries=0) as stranger:
        with pytest.raises(openai.AuthenticationError):
            stranger.responses.create(model="m", input="x")
    with pytest.raises(anthropic.APIStatusError) as caught:
        claude.messages.create(model="m", max_tokens=1, messages=[{"role": "user", "content": "x" * 70000}])
    assert caught.value.status_code == 413


@pytest.mark.parametrize(
    ("call", "words"),
    [
        (lambda c: c.chat.completions.create(model="m", messages=[], max_tokens=2), "messages"),
        (lambda c: c.chat.completions.create(model="m", messages=MESSAGES, top_logprobs=2), "logprobs"),
        (
            lambda c: c.chat.completions.create(
                model="m", messages=MESSAGES, stream=True, extra_body={"return_meta_info": True}
            ),
            "streaming",
        ),
        (
            lambda c: c.chat.completions.create(model="m", messages=MESSAGES, max_tokens=100000),
            "context length",
        ),
        (lambda c: c.chat.completions.create(model="m", messages=MESSAGES, temperature=-1), "temperature"),
        (lambda c: c.chat.completions.create(model="m", messages=MESSAGES, n=0), "'n'"),
        (
            lambda c: c.chat.completions.create(
                model="m", messages=MESSAGES, response_format={"type": "json_object"}
            ),
            "constrained decoding",
        ),
        (
            lambda c: c.chat.completions.create(
                model="m",
                messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
            ),
            "images need a vision-language model, and this engine's model is not one",
        ),
        (
            lambda c: c.completions.create(model="m", prompt="1", extra_body={"stop_token_ids": [10**6]}),
            "stop_token_ids",
        ),
        (lambda c: c.completions.create(model="m", prompt=[10**6]), "vocabulary"),
        (  # the template is the model's: a request's own is refused (no --trust-request-chat-template)
            lambda c: c.chat.completions.create(
                model="m", messages=MESSAGES, extra_body={"chat_template_kwargs": {"chat_template": "{{ 1 }}"}}
            ),
            "--trust-request-chat-template",
        ),
        (
            lambda c: c.chat.completions.create(model="m", messages=MESSAGES, extra_body={"chat_template": "x"}),
            "--trust-request-chat-template",
        ),
    ],
)
def test_bad_requests_are_sglang_error_responses(client: openai.OpenAI, call: Any, words: str) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        result = call(client)
        for _ in result:  # a stream that was (wrongly) accepted
            pass
    body = caught.value.body
    assert caught.value.status_code == 400
    assert body["object"] == "error" and body["code"] == 400 and body["type"] == "BadRequestError"
    assert words in body["message"]


def test_api_key_and_body_limit(engine_url: str, client: openai.OpenAI) -> None:
    with openai.OpenAI(base_url=engine_url + "/v1", api_key="wrong", max_retries=0) as stranger:
        with pytest.raises(openai.AuthenticationError):
            stranger.models.list()
        with pytest.raises(openai.AuthenticationError):
            stranger.chat.completions.create(model="m", messages=MESSAGES, max_tokens=1)
    with pytest.raises(openai.APIStatusError) as caught:
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x" * 70000}])
    assert caught.value.status_code == 413
