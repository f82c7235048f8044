"""OpenAI request bodies mapped onto the engine's /generate body as SGLang's to_sampling_params maps them."""

from __future__ import annotations

import pytest

from workers.engine.openai_protocol import chat_request, completion_request, normalise_messages
from workers.engine.sampling_params import RequestError

MESSAGES = [{"role": "user", "content": "hi"}]


def test_chat_fields_map_to_sglang_sampling_params() -> None:
    spec = chat_request({"messages": MESSAGES, "max_tokens": 5, "max_completion_tokens": 7, "seed": 3, "n": 2,
                         "stop": ["x"], "stop_token_ids": [4], "min_tokens": 1, "top_k": 9, "no_stop_trim": True,
                         "skip_special_tokens": False, "logprobs": True, "top_logprobs": 2, "rid": "r",
                         "chat_template_kwargs": {"enable_thinking": False}, "tools": [{"type": "function",
                         "function": {"name": "f"}}], "unknown_field": 1}, "model-dir")
    params = spec.body["sampling_params"]
    assert params["max_new_tokens"] == 7  # max_completion_tokens wins, as SGLang's
    assert (params["sampling_seed"], params["n"], params["min_new_tokens"], params["top_k"]) == (3, 2, 1, 9)
    assert params["stop"] == ["x"] and params["stop_token_ids"] == [4] and params["no_stop_trim"] is True
    assert params["skip_special_tokens"] is False and params["spaces_between_special_tokens"] is True
    assert spec.body["return_logprob"] is True and spec.body["top_logprobs_num"] == 2 and spec.body["rid"] == "r"
    assert spec.model == "model-dir" and spec.chat and not spec.stream
    assert spec.template_kwargs["enable_thinking"] is False and spec.template_kwargs["add_generation_prompt"]
    assert spec.template_kwargs["tools"] == [{"name": "f"}]
    assert chat_request({"messages": MESSAGES}, "m").body["sampling_params"]["max_new_tokens"] is None


def test_chat_input_ids_skip_the_template_and_continue_final_message_drops_the_generation_prompt() -> None:
    spec = chat_request({"messages": MESSAGES, "input_ids": [1, 2, 3]}, "m")
    assert spec.messages is None and spec.body["input_ids"] == [1, 2, 3]
    last = chat_request({"messages": [*MESSAGES, {"role": "assistant", "content": "he"}],
                         "continue_final_message": True}, "m")
    assert last.template_kwargs["add_generation_prompt"] is False


@pytest.mark.parametrize(("body", "words"), [
    ({"messages": MESSAGES, "top_logprobs": 3}, "requires 'logprobs'"),
    ({"messages": MESSAGES, "top_logprobs": 21, "logprobs": True}, "top_logprobs"),
    ({"messages": MESSAGES, "stream": True, "return_meta_info": True}, "not supported with streaming"),
    ({"messages": MESSAGES, "stream_options": {"include_usage": True}}, "only allowed when 'stream'"),
    ({"messages": MESSAGES, "max_tokens": -1}, "max_tokens"),
    ({"messages": MESSAGES, "lora_path": "a"}, "LoRA"),
    ({"messages": "hi"}, "'messages'"),
    ({"messages": [{"content": "no role"}]}, "role"),
    ({"messages": MESSAGES, "logprobs": "yes"}, "'logprobs'"),
    ({"messages": MESSAGES, "input_ids": [[1], [2]]}, "input_ids"),
])
def test_chat_refusals_name_the_field(body: dict, words: str) -> None:
    with pytest.raises(RequestError, match=words.replace("(", r"\(")):
        chat_request(body, "m")


def test_completions_map_prompts_logprobs_and_echo() -> None:
    spec = completion_request({"prompt": "12", "logprobs": 2, "echo": True}, "m")
    assert spec.body["text"] == "12" and spec.body["sampling_params"]["max_new_tokens"] == 16  # OpenAI's default
    assert spec.body["top_logprobs_num"] == 2 and spec.body["logprob_start_len"] == 0 and spec.echo
    assert completion_request({"prompt": [[1, 2], [3]], "max_tokens": 2}, "m").body["input_ids"] == [[1, 2], [3]]
    assert completion_request({"prompt": ["a", "b"]}, "m").body["text"] == ["a", "b"]
    for bad in ({"prompt": 5}, {"prompt": []}, {"prompt": "a", "suffix": "b"}, {"prompt": "a", "best_of": 3}):
        with pytest.raises(RequestError):
            completion_request(bad, "m")


def test_message_content_parts_are_joined_and_others_refused() -> None:
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
             {"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}]
    assert normalise_messages(parts) == [{"role": "user", "content": "a\nb"},
                                         {"role": "assistant", "content": "", "tool_calls": [{"id": "1"}]}]
    with pytest.raises(RequestError, match="only text parts"):
        normalise_messages([{"role": "user", "content": [{"type": "image_url"}]}])
    # a vision-language model's chat: a message with images keeps its parts, each image an `image` part where the
    # template writes its placeholder; the URLs collected in order; a text-only message still joined
    urls: list[str] = []
    chat = [{"role": "system", "content": [{"type": "text", "text": "s"}]},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "u1"}},
                                         {"type": "image_url", "image_url": "u2"}]}]
    assert normalise_messages(chat, urls) == [
        {"role": "system", "content": "s"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image"}, {"type": "image"}]}]
    assert urls == ["u1", "u2"]
    for bad in ({"type": "image_url"}, {"type": "image_url", "image_url": {"url": ""}}, {"type": "audio"}):
        with pytest.raises(RequestError, match="content"):
            normalise_messages([{"role": "user", "content": [bad]}], [])


def test_a_vlm_chats_image_parts_reach_the_template_as_sglangs_chat_route_hands_them() -> None:
    """Against SGLang's own code (the wheel's `process_content_for_template_format`, 'openai' content format, which
    its chat route uses for a VLM's template): each message's parts and the image URLs collected, in order, are
    the engine's — `{"image_url": {"url": ...}}` and the bare-string form alike."""
    from tests.support.sglang_parts import template_content_processor

    process = template_content_processor()
    messages = [{"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "which colour?"},
                                             {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}},
                                             {"type": "image_url", "image_url": "data:image/png;base64,BB"},
                                             {"type": "text", "text": "and this?"}]},
                {"role": "assistant", "content": "red"}]
    theirs_urls: list[object] = []
    theirs = [process(dict(message), "openai", theirs_urls, [], [], []) for message in messages]
    ours_urls: list[str] = []
    ours = normalise_messages(messages, ours_urls)
    assert [image.url for image in theirs_urls] == ours_urls == ["data:image/png;base64,AA",
                                                                  "data:image/png;base64,BB"]
    assert ours[1] == theirs[1] and [m["content"] for m in ours] == [m["content"] for m in theirs]
