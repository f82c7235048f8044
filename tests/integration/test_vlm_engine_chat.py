"""The engine's chat-family routes on a vision-language model, through the official SDKs, as SGLang serves them:
an OpenAI `image_url` part, an Anthropic `image` block and a Responses `input_image` each reach the model as the
same prompt `/generate` builds from the rendered text and `image_data` — the image's placeholder expanded to its
grid's tokens — so the greedy answer, its logprobs and the prompt's token count are `/generate`'s; count_tokens
counts the image's tokens; a bad image is a 400 naming it. An `sglang` OPD teacher's request carries the sample's
images too."""

from __future__ import annotations

import base64
from collections.abc import Iterator

import anthropic
import httpx
import openai
import pytest

from tests.support.engine_proc import start_engine
from tests.support.hostile_images import solid_png

KEY = "vlm-key"
PNG = solid_png(56, 56, (255, 0, 0))  # 4x4 patches of 14, merged 2x2: 4 image tokens
URL = "data:image/png;base64," + base64.b64encode(PNG).decode()
GREEDY = {"temperature": 0.0}


@pytest.fixture(scope="module")
def vlm_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    from workers.tiny_vlm import build_tiny_vlm

    with start_engine(build_tiny_vlm(tmp_path_factory.mktemp("tiny-vlm")), api_key=KEY) as url:
        yield url


def rolled_text(url: str, messages: list[dict[str, object]]) -> str:
    """The messages through the engine's model's chat template, one placeholder an image."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(httpx.get(f"{url}/model_info", headers=auth()).json()["model_path"])
    return str(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))


def generate(url: str, messages: list[dict[str, object]]) -> dict[str, object]:
    """/generate on the template's text and `image_data`: the engine expands the placeholder itself."""
    reply = httpx.post(f"{url}/generate", headers=auth(), timeout=60, json={
        "text": rolled_text(url, messages), "image_data": [URL], "return_logprob": True,
        "sampling_params": {"max_new_tokens": 4, **GREEDY, "skip_special_tokens": False}})
    assert reply.status_code == 200, reply.text
    return reply.json()


def auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {KEY}"}


def test_an_image_in_each_wire_format_is_the_generate_prompt_with_its_image(vlm_url: str) -> None:
    template_messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "colour?"}]}]
    floor = generate(vlm_url, template_messages)
    meta = floor["meta_info"]
    expected_ids = [token for _, token, _ in meta["output_token_logprobs"]]

    with openai.OpenAI(base_url=f"{vlm_url}/v1", api_key=KEY, max_retries=0, timeout=60) as gpt:
        chat = gpt.chat.completions.create(
            model="m", max_tokens=4, temperature=0.0, logprobs=True,
            messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": URL}},
                                                   {"type": "text", "text": "colour?"}]}],
            extra_body={"return_meta_info": True, "skip_special_tokens": False})
        chat_meta = chat.choices[0].model_extra["meta_info"]  # type: ignore[index]
        assert chat.usage is not None and chat.usage.prompt_tokens == meta["prompt_tokens"]
        assert [token for _, token, _ in chat_meta["output_token_logprobs"]] == expected_ids
        assert [lp for lp, _, _ in chat_meta["output_token_logprobs"]] == pytest.approx(
            [lp for lp, _, _ in meta["output_token_logprobs"]], abs=1e-5)
        text_only = gpt.chat.completions.create(model="m", max_tokens=1,
                                                messages=[{"role": "user", "content": "colour?"}])
        assert text_only.usage is not None
        assert meta["prompt_tokens"] == text_only.usage.prompt_tokens + 2 + 4  # vision start/end, 4 image tokens

        streamed = gpt.chat.completions.create(
            model="m", max_tokens=4, temperature=0.0, stream=True,
            messages=[{"role": "user", "content": [{"type": "image_url", "image_url": URL},
                                                   {"type": "text", "text": "colour?"}]}])
        assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == \
            chat.choices[0].message.content

        responses = gpt.responses.create(
            model="m", max_output_tokens=4, temperature=0.0,
            input=[{"role": "user", "content": [{"type": "input_image", "image_url": URL},
                                                {"type": "input_text", "text": "colour?"}]}])
        assert responses.usage is not None and responses.usage.input_tokens == meta["prompt_tokens"]

        with pytest.raises(openai.BadRequestError) as bad:
            gpt.chat.completions.create(model="m", max_tokens=1, messages=[{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,bm90IGFuIGltYWdl"}}]}])
        assert "image 0" in str(bad.value) or "image_data" in str(bad.value)

    block = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": base64.b64encode(PNG).decode()}}
    with anthropic.Anthropic(base_url=vlm_url, api_key=KEY, max_retries=0, timeout=60) as claude:
        asked = [{"role": "user", "content": [block, {"type": "text", "text": "colour?"}]}]
        message = claude.messages.create(model="m", max_tokens=4, messages=asked, extra_body=GREEDY)  # type: ignore[arg-type]
        assert message.usage.input_tokens == meta["prompt_tokens"]
        assert claude.messages.count_tokens(model="m", messages=asked).input_tokens == meta["prompt_tokens"]  # type: ignore[arg-type]


def test_an_sglang_teacher_scores_a_vlm_sample_with_its_images(vlm_url: str) -> None:
    """On-policy distillation's `sglang` teacher (`TeacherScorer`'s request): a sample with images is scored with
    them, so a teacher with the policy's weights gives the logprobs the policy's engine sampled with (without the
    images it scored the tokens after a placeholder that stood for nothing)."""
    import io

    from PIL import Image

    from coordinator.rollout.teacher import score_payload
    from replay.sample import Sample

    template_messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "colour?"}]}]
    rolled = generate(vlm_url, template_messages)
    prefilled = httpx.post(f"{vlm_url}/generate", headers=auth(), timeout=60, json={
        "text": rolled_text(vlm_url, template_messages), "image_data": [URL], "return_logprob": True,
        "logprob_start_len": 0, "sampling_params": {"max_new_tokens": 0}}).json()
    prompt = [token for _, token, _ in prefilled["meta_info"]["input_token_logprobs"]]  # the image's tokens expanded
    response = rolled["meta_info"]["output_token_logprobs"]
    sample = Sample(tokens=prompt + [token for _, token, _ in response], response_length=len(response),
                    multimodal_inputs={"images": [Image.open(io.BytesIO(PNG)).convert("RGB")]})
    payload = score_payload(sample)
    assert len(payload["image_data"]) == 1  # type: ignore[arg-type]
    scored = httpx.post(f"{vlm_url}/generate", headers=auth(), timeout=60, json=payload)
    assert scored.status_code == 200, scored.text
    teacher = [logprob for logprob, _, _ in scored.json()["meta_info"]["input_token_logprobs"]][-len(response):]
    assert teacher == pytest.approx([logprob for logprob, _, _ in response], abs=1e-5)
