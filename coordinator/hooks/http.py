"""slime's `post` / `get` HTTP helpers for hooks, on our engine client.

Owns how a hook's HTTP request goes out: through the run's hook client (`HookRuntime`; one pool, deadlines,
retries of transport errors and 5xx only with backoff inside a budget, a 4xx raised at once with the server's
message — slime's helper retries every error 60 times), with the route of the hook call and the engines' API
key added when the URL is the run's own address (the coordinator's endpoint or the router). Outside a run (a
hook tested on its own) each call opens a short-lived client.

Invariant: a hook sees the parsed JSON body (or the text when the body is not JSON), or an `EngineError`
subclass naming the URL; never an httpx or aiohttp exception. Bodies are read under a cap and decoded bounded
(`coordinator.engines.bounded`); a `/generate` reply is checked like the dispatcher's (`EngineReplyError`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from coordinator.engines.bounded import DEFAULT_REPLY_BYTES, decode_reply, generate_reply_limit
from coordinator.engines.errors import EngineHTTPError, EngineReplyError
from coordinator.engines.policy import RetryPolicy
from coordinator.engines.replies import check_generate_body_async
from coordinator.hooks.runtime import ROUTE_HEADER, current_call

if TYPE_CHECKING:
    from coordinator.engines.client import EngineClient

#: how the boundary decoder's refusal of a body that is not JSON begins (workers/boundary/json_input.py)
NOT_JSON = "not valid JSON"
#: Read deadline of one hook request: a generate call can take long (slime's router waits up to 4 hours).
REQUEST_TIMEOUT_S = 3600.0


def _split(url: str) -> tuple[str, str]:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"post/get need an http(s) URL, got {url!r}")
    path = parts.path or "/"
    if parts.query:
        path += "?" + parts.query
    return f"{parts.scheme}://{parts.netloc}", path


def outgoing_headers(url: str, headers: Mapping[str, str] | None) -> dict[str, str]:
    """The headers a hook's request to `url` carries: `headers`, plus — only to the run's own address, inside a
    hook call — its route token and the API key."""
    merged = dict(headers or {})
    call = current_call()
    if call is not None and call.runtime.is_own_address(url):
        if call.route_token is not None:
            merged.setdefault(ROUTE_HEADER, call.route_token)
        if call.runtime.api_key:
            merged.setdefault("Authorization", f"Bearer {call.runtime.api_key}")
    return merged


async def _send(client: EngineClient, method: str, url: str, payload: Any, retry: RetryPolicy,
                headers: dict[str, str]) -> Any:
    base, path = _split(url)
    generate = path.split("?", 1)[0].endswith("/generate") and isinstance(payload, dict)
    cap = generate_reply_limit(payload) if generate else DEFAULT_REPLY_BYTES
    response = await client.request(base, method, path, json_body=payload, timeout=REQUEST_TIMEOUT_S,
                                    retry=retry, headers=headers, max_bytes=cap)
    try:
        body = await decode_reply(response.content, url, cap)
    except EngineReplyError as error:
        if error.reason.startswith(NOT_JSON):
            return response.text  # slime's helper: a body that is not JSON comes back as its text
        raise
    if generate and not (isinstance(body, dict) and "error" in body):  # an engine's or the router's reply
        await check_generate_body_async(body, url, payload, client.vocab_size)
    return body


async def _request(method: str, url: str, payload: Any, max_retries: int, headers: Mapping[str, str] | None
                   ) -> Any:
    retry = RetryPolicy(attempts=max(1, int(max_retries)), backoff=0.5, backoff_max=5.0, budget=300.0)
    sent = outgoing_headers(url, headers)
    call = current_call()
    client = call.runtime.http if call is not None else None
    if client is not None:
        return await _send(client, method, url, payload, retry, sent)
    # Outside a run only: imported here so that importing `coordinator.hooks` (what user code and a replay
    # run do) does not import httpx and aiohttp.
    from coordinator.engines.client import EngineClient

    async with EngineClient(max_connections=4) as own:
        return await _send(own, method, url, payload, retry, sent)


async def post(url: str, payload: Any, max_retries: int = 60, headers: Mapping[str, str] | None = None) -> Any:
    """slime's `post(url, payload, max_retries=60, headers=None)`: POST JSON, return the parsed response.
    `max_retries` bounds the attempts on transport errors and 5xx (within 300 s); a 4xx raises at once."""
    if payload is None:
        raise EngineHTTPError(0, "post needs a JSON payload", url)
    return await _request("POST", url, payload, max_retries, headers)


async def get(url: str, max_retries: int = 60, headers: Mapping[str, str] | None = None) -> Any:
    """slime's `get(url)`: GET, return the parsed response."""
    return await _request("GET", url, None, max_retries, headers)
