"""A miles-style agent on a vision-language policy, for the session server with images (docs/vlm.md), written
only against the official SDKs: its prompt's image arrives as an OpenAI `image_url` part (a PNG data URL). Agents
take turns at the three formats the session serves — `openai` chat completions, `anthropic` Messages (an `image`
block with a base64 source) and `openai` Responses (an `input_image` part) — so one run covers each. Each first
sends the question with an http URL (which the session must refuse, 400) and then the prompt itself, and returns
what it saw for the test to compare with the dumped sample.
"""

from __future__ import annotations

import itertools
from collections.abc import Awaitable, Callable
from typing import Any

import anthropic
import openai

FORMATS = ("chat", "messages", "responses")
_turns = itertools.count()  # which format the next agent uses (agents of one run share this module)
HTTP_IMAGE = "http://127.0.0.1:9/x.png"


async def run_agent(*, base_url: str, prompt: list[dict[str, Any]], request_kwargs: dict[str, Any],
                    metadata: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
    parts = prompt[0]["content"]
    urls = [part["image_url"]["url"] for part in parts if part.get("type") == "image_url"]
    fmt = FORMATS[next(_turns) % len(FORMATS)]
    api_key = kwargs.get("api_key", "EMPTY")
    if fmt == "messages":
        refused, meta = await _messages(base_url, api_key, parts, request_kwargs)
    elif fmt == "responses":
        refused, meta = await _responses(base_url, api_key, parts, request_kwargs)
    else:
        refused, meta = await _chat(base_url, api_key, prompt, request_kwargs)
    return {"format": fmt, "urls": len(urls), "http_refused": refused,
            "reply_ids": [pair[1] for pair in meta["output_token_logprobs"]]}


async def _refused_then_answered(create: Callable[[list[dict[str, Any]]], Awaitable[Any]],
                                 refused_with: type[Exception], fetched: list[dict[str, Any]],
                                 prompt: list[dict[str, Any]]) -> tuple[str, Any]:
    """The question with an http image URL (the session must refuse it: its error text, else ""), then the prompt
    itself (the reply)."""
    try:
        await create(fetched)
        refused = ""
    except refused_with as error:
        refused = str(error)
    return refused, await create(prompt)


async def _chat(base_url: str, api_key: str, prompt: list[dict[str, Any]], request_kwargs: dict[str, Any]
                ) -> tuple[str, dict[str, Any]]:
    parts = prompt[0]["content"]
    fetched = [{**prompt[0], "content": [{"type": "image_url", "image_url": {"url": HTTP_IMAGE}}
                                         if part.get("type") == "image_url" else part for part in parts]}]
    async with openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key=api_key, max_retries=0) as client:
        refused, reply = await _refused_then_answered(
            lambda messages: client.chat.completions.create(model="policy", messages=messages,
                                                            extra_body=request_kwargs),
            openai.BadRequestError, fetched, prompt)
    return refused, reply.choices[0].model_extra["meta_info"]


def _anthropic_block(part: dict[str, Any], url: str | None = None) -> dict[str, Any]:
    if part.get("type") != "image_url":
        return {"type": "text", "text": part["text"]}
    if url is not None:
        return {"type": "image", "source": {"type": "url", "url": url}}
    media, data = part["image_url"]["url"].removeprefix("data:").split(";base64,", 1)
    return {"type": "image", "source": {"type": "base64", "media_type": media, "data": data}}


def _responses_part(part: dict[str, Any], url: str | None = None) -> dict[str, Any]:
    if part.get("type") != "image_url":
        return {"type": "input_text", "text": part["text"]}
    return {"type": "input_image", "image_url": url or part["image_url"]["url"], "detail": "auto"}


def _extra(request_kwargs: dict[str, Any]) -> dict[str, Any]:
    """The rollout's sampling params but the length, which both formats take under their own name."""
    return {**{k: v for k, v in request_kwargs.items() if k != "max_tokens"}, "return_meta_info": True}


async def _messages(base_url: str, api_key: str, parts: list[dict[str, Any]], request_kwargs: dict[str, Any]
                    ) -> tuple[str, dict[str, Any]]:
    def user(url: str | None) -> list[dict[str, Any]]:
        return [{"role": "user", "content": [_anthropic_block(part, url) for part in parts]}]

    async with anthropic.AsyncAnthropic(base_url=base_url, auth_token=api_key, max_retries=0) as client:
        refused, reply = await _refused_then_answered(
            lambda messages: client.messages.create(model="policy", max_tokens=request_kwargs["max_tokens"],
                                                    messages=messages, extra_body=_extra(request_kwargs)),
            anthropic.BadRequestError, user(HTTP_IMAGE), user(None))
    return refused, reply.model_extra["meta_info"]


async def _responses(base_url: str, api_key: str, parts: list[dict[str, Any]], request_kwargs: dict[str, Any]
                     ) -> tuple[str, dict[str, Any]]:
    def user(url: str | None) -> list[dict[str, Any]]:
        return [{"role": "user", "content": [_responses_part(part, url) for part in parts]}]

    async with openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key=api_key, max_retries=0) as client:
        refused, reply = await _refused_then_answered(
            lambda items: client.responses.create(model="policy", input=items,
                                                  max_output_tokens=request_kwargs["max_tokens"],
                                                  extra_body=_extra(request_kwargs)),
            openai.BadRequestError, user(HTTP_IMAGE), user(None))
    return refused, reply.model_extra["meta_info"]
