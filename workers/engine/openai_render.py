"""The engine's /generate results → OpenAI response objects, as SGLang 0.5's serving_chat /
serving_completions build them (ChatCompletionResponse, CompletionResponse, their stream chunks, usage).

Owns the response shapes only (no I/O). Each input `item` is one sequence as `/generate` renders it with
token texts (`{"text", "output_ids", "meta_info"}`; `meta_info.output_token_logprobs` are
`[logprob, token_id, token_text]`), so the numbers an OpenAI client sees are exactly those of /generate.

Invariants: `usage.prompt_tokens` counts each prompt once however large `n` is (SGLang's stride by n);
`choices[i].meta_info` is present only when `return_meta_info` asked for it; `finish_reason` is the engine's
finish type and `matched_stop` the matched stop string or token id.
"""

from __future__ import annotations

import time
from typing import Any

from workers.boundary.json_input import JsonValue

JsonDict = dict[str, Any]


def error_body(message: str, status: int, kind: str = "BadRequestError") -> JsonDict:
    """SGLang's ErrorResponse (`object: error`, `message`, `type`, `param`, `code`)."""
    return {"object": "error", "message": message, "type": kind, "param": None, "code": status}


def _finish(meta: JsonDict) -> tuple[str | None, JsonValue]:
    reason = meta.get("finish_reason")
    if not reason:
        return None, None
    return reason.get("type"), reason.get("matched")


def usage(items: list[JsonDict], n: int) -> JsonDict:
    prompt = sum(items[i]["meta_info"]["prompt_tokens"] for i in range(0, len(items), max(n, 1)))
    completion = sum(item["meta_info"]["completion_tokens"] for item in items)
    return {
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion,
        "completion_tokens": completion,
        "prompt_tokens_details": None,
        "reasoning_tokens": 0,
    }


def _token_bytes(text: str | None) -> list[int]:
    return list((text or "").encode("utf-8"))


def chat_logprobs(meta: JsonDict, start: int = 0, end: int | None = None) -> JsonDict:
    """ChoiceLogprobs for the output tokens [start, end)."""
    tokens = meta.get("output_token_logprobs") or []
    tops = meta.get("output_top_logprobs") or []
    content = []
    for index in range(start, len(tokens) if end is None else end):
        logprob, _token, text = tokens[index]
        top = tops[index] if index < len(tops) else []
        content.append(
            {
                "token": text or "",
                "bytes": _token_bytes(text),
                "logprob": logprob,
                "top_logprobs": [
                    {"token": t or "", "bytes": _token_bytes(t), "logprob": lp} for lp, _id, t in top
                ],
            }
        )
    return {"content": content}


def chat_response(items: list[JsonDict], *, model: str, n: int, logprobs: bool, meta_info: bool) -> JsonDict:
    choices = []
    for index, item in enumerate(items):
        meta = item["meta_info"]
        finish, matched = _finish(meta)
        choice: JsonDict = {
            "index": index,
            "message": {"role": "assistant", "content": item["text"] or "", "reasoning_content": None},
            "logprobs": chat_logprobs(meta) if logprobs else None,
            "finish_reason": finish,
            "matched_stop": matched,
        }
        if meta_info:
            choice["meta_info"] = dict(meta)
        choices.append(choice)
    return {
        "id": items[0]["meta_info"]["id"],
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": usage(items, n),
        "metadata": {"weight_version": items[0]["meta_info"].get("weight_version")},
    }


def completion_logprobs(meta: JsonDict, *, echo: bool, start: int = 0, end: int | None = None) -> JsonDict:
    """SGLang's to_openai_style_logprobs: tokens, token_logprobs, top_logprobs (dicts), text_offset -1."""
    rows: list[list[Any]] = []
    tops: list[Any] = []
    if echo:
        rows += meta.get("input_token_logprobs") or []
        tops += meta.get("input_top_logprobs") or [None] * len(meta.get("input_token_logprobs") or [])
    output = (meta.get("output_token_logprobs") or [])[start:end]
    rows += output
    if meta.get("output_top_logprobs") is not None:
        tops += (meta.get("output_top_logprobs") or [])[start:end]
    return {
        "text_offset": [-1] * len(rows),
        "token_logprobs": [row[0] for row in rows],
        "tokens": [row[2] or "" for row in rows],
        "top_logprobs": [None if entry is None else {t or "": lp for lp, _id, t in entry} for entry in tops],
    }


def completion_response(
    items: list[JsonDict], *, model: str, n: int, logprobs: bool, echo_texts: list[str] | None
) -> JsonDict:
    choices = []
    for index, item in enumerate(items):
        meta = item["meta_info"]
        finish, matched = _finish(meta)
        text = item["text"]
        if echo_texts is not None:
            text = echo_texts[index // max(n, 1)] + text
        choices.append(
            {
                "index": index,
                "text": text,
                "logprobs": completion_logprobs(meta, echo=echo_texts is not None) if logprobs else None,
                "finish_reason": finish,
                "matched_stop": matched,
            }
        )
    return {
        "id": items[0]["meta_info"]["id"],
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": usage(items, n),
        "metadata": {"weight_version": items[0]["meta_info"].get("weight_version")},
    }


def chunk(kind: str, chunk_id: str, model: str, choices: list[JsonDict], created: int) -> JsonDict:
    """One stream event: `chat.completion.chunk` or `text_completion`."""
    return {"id": chunk_id, "object": kind, "created": created, "model": model, "choices": choices}
