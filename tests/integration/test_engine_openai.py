"""The engine's OpenAI-compatible endpoints, driven by the official `openai` SDK against a real engine process.

What is checked is behaviour a client relies on: the chat prompt is the model's chat template (the same
tokens and logprobs as `/generate` on the template's ids), `input_ids` replace the messages, stops, seeds
and `n` act as in /generate, streams concatenate to the non-streamed answer, logprobs agree with
`meta_info.output_token_logprobs`, and errors are SGLang's 4xx `ErrorResponse` (401 without the API key).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

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
            "text parts",
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
