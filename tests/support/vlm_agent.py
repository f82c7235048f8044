"""A miles-style agent on a vision-language policy, written only against the `openai` SDK, for the session
server with images (docs/vlm.md): its prompt's image arrives as an OpenAI `image_url` part (a PNG data URL);
it first sends the same question with an http URL (which the session must refuse, 400) and then the prompt
itself, and returns what it saw for the test to compare with the dumped sample.
"""

from __future__ import annotations

from typing import Any

import openai


async def run_agent(*, base_url: str, prompt: list[dict[str, Any]], request_kwargs: dict[str, Any],
                    metadata: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
    parts = prompt[0]["content"]
    urls = [part["image_url"]["url"] for part in parts if part.get("type") == "image_url"]
    fetched = [{**prompt[0], "content": [{"type": "image_url", "image_url": {"url": "http://127.0.0.1:9/x.png"}}
                                          if part.get("type") == "image_url" else part for part in parts]}]
    async with openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key=kwargs.get("api_key", "EMPTY"),
                                  max_retries=0) as client:
        try:
            await client.chat.completions.create(model="policy", messages=fetched, extra_body=request_kwargs)
            refused = ""
        except openai.BadRequestError as error:
            refused = str(error)
        reply = await client.chat.completions.create(model="policy", messages=prompt, extra_body=request_kwargs)
    meta = reply.choices[0].model_extra["meta_info"]
    return {"urls": len(urls), "http_refused": refused, "reply": reply.choices[0].message.content,
            "reply_ids": [pair[1] for pair in meta["output_token_logprobs"]]}
