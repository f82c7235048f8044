"""The shared HTTP layer's gates as properties, on one real server (an echo app on `HttpService`):

- a request head is served when it is at most `max_head_bytes` and answered 431 when it is over, whatever
  its size and line endings;
- a JSON body is echoed when within the depth limit and a 400 naming the limit past it, never a 500;
- a declared body over the limit is a 413 before the app runs; under it the app reads it;
- the API key: any Authorization header but the exact Bearer key is a 401 on a guarded path; /health is open;
- CONNECT, to a path whose app answers any method 200 (as the status page does), is a 405 and logs nothing at
  ERROR (answered 200, h11 switched the connection to a tunnel and uvicorn logged a traceback);
- `beyond_loopback`: only 127.0.0.0/8, ::1 and localhost stay on the machine.
"""

from __future__ import annotations

import ipaddress
import json
import logging
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from anyio.from_thread import start_blocking_portal
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from tests.support.sockets import raw_exchange
from workers.boundary.errors import BoundaryError
from workers.boundary.exposure import beyond_loopback
from workers.boundary.http_gates import (
    ApiKeyMiddleware,
    BodyLimitMiddleware,
    error_response,
    read_json,
)
from workers.boundary.http_guard import ServerLimits
from workers.boundary.http_server import HttpService
from workers.boundary.json_input import JsonLimits

KEY = "gates-key-91c"
MAX_BODY = 4096
DEPTH = 8
LIMITS = ServerLimits(max_head_bytes=2048, idle_s=10.0, head_s=10.0)
HOST = "127.0.0.1"
PROPERTY = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


async def echo(request: Request) -> Response:
    try:
        return JSONResponse(await read_json(request, MAX_BODY, limits=JsonLimits(max_bytes=MAX_BODY, max_depth=DEPTH)))
    except BoundaryError as error:
        return error_response(str(error))


async def ok(_request: Request) -> Response:
    return JSONResponse({})


def app() -> Any:
    routes = [Route("/health", ok, methods=["GET"]), Route("/echo", echo, methods=["POST"])]
    guarded = ApiKeyMiddleware(BodyLimitMiddleware(Starlette(routes=routes), MAX_BODY), KEY)
    page = Response("page", media_type="text/html")

    async def served(scope: Any, receive: Any, send: Any) -> None:  # the status server's shape: "/" is open
        if scope["type"] == "http" and scope["path"] == "/":
            await page(scope, receive, send)
        else:
            await guarded(scope, receive, send)

    return served


@pytest.fixture(scope="module")
def port() -> Iterator[int]:
    with start_blocking_portal() as portal:
        running, service = portal.start_task(HttpService(app=app(), limits=LIMITS).run)
        try:
            yield service.port
        finally:
            running.cancel()


@pytest.fixture(scope="module")
def http(port: int) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=f"http://{HOST}:{port}", timeout=30) as client:
        yield client


@PROPERTY
@given(pad=st.integers(0, 3000), bare_lf=st.booleans())
@example(pad=1987, bare_lf=False).via("a head of exactly the limit")
@example(pad=1988, bare_lf=False).via("one byte over")
@example(pad=1992, bare_lf=True).via("exactly the limit, bare LF")
@example(pad=1993, bare_lf=True).via("one byte over, bare LF")
def test_a_head_is_served_up_to_the_limit_and_431_past_it(port: int, pad: int, bare_lf: bool) -> None:
    end = b"\n" if bare_lf else b"\r\n"
    head = end.join([b"GET /health HTTP/1.1", b"Host: x", b"Connection: close", b"X-Pad: " + b"a" * pad, b"", b""])
    reply = raw_exchange(HOST, port, head)
    expected = b"431" if len(head) > LIMITS.max_head_bytes else b"200"
    assert reply.split(b" ", 2)[1] == expected, (len(head), reply[:120])


@PROPERTY
@given(depth=st.integers(1, 40), leaf=st.sampled_from(["1", '"x"', "null", "{}"]))
def test_json_within_the_depth_is_echoed_and_past_it_is_a_400(http: httpx.Client, depth: int, leaf: str) -> None:
    body = '{"a":' + "[" * (depth - 1) + leaf + "]" * (depth - 1) + "}"
    reply = http.post("/echo", content=body, headers={"Authorization": f"Bearer {KEY}"})
    value_depth = depth + (leaf == "{}")
    if value_depth <= DEPTH:
        assert reply.status_code == 200 and reply.json() == json.loads(body)
    else:
        assert reply.status_code == 400 and f"nested deeper than {DEPTH}" in reply.json()["error"]["message"]


@PROPERTY
@given(size=st.integers(0, 2 * MAX_BODY))
def test_a_declared_body_over_the_limit_is_413(http: httpx.Client, size: int) -> None:
    body = b'"' + b"a" * max(size - 2, 0) + b'"' if size >= 2 else b" " * size
    reply = http.post("/echo", content=body, headers={"Authorization": f"Bearer {KEY}"})
    assert reply.status_code == (413 if len(body) > MAX_BODY else 400 if size >= 2 else 200), reply.text[:200]


@PROPERTY
@given(given_key=st.one_of(st.just(KEY), st.text(st.characters(min_codepoint=33, max_codepoint=126), min_size=1,
                                                 max_size=40)))
def test_only_the_exact_bearer_key_passes_and_health_is_open(http: httpx.Client, given_key: str) -> None:
    headers = {"Authorization": f"Bearer {given_key}"}
    guarded = http.post("/echo", content=b"{}", headers=headers)
    assert guarded.status_code == (200 if given_key == KEY else 401)
    assert http.get("/health", headers=headers).status_code == 200


@pytest.mark.parametrize("target", [b"/", b"x.example:443", b"/health"])
def test_connect_is_a_405_and_logs_no_traceback(port: int, target: bytes, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    request = b"CONNECT " + target + b" HTTP/1.1\r\nHost: x\r\n\r\nGET / HTTP/1.1\r\nHost: x\r\n\r\n"
    reply = raw_exchange(HOST, port, request)
    assert reply.startswith(b"HTTP/1.1 405 "), reply[:200]
    assert b"CONNECT is not served" in reply
    assert raw_exchange(HOST, port, b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").startswith(
        b"HTTP/1.1 200 ")  # the page itself is still served
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info], caplog.text[-2000:]


@given(address=st.ip_addresses())
def test_only_loopback_addresses_stay_on_the_machine(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> None:
    assert beyond_loopback(str(address)) is not address.is_loopback
    assert beyond_loopback(f"[{address}]") is not address.is_loopback


def test_names_and_wildcards_are_beyond_loopback() -> None:
    assert not beyond_loopback("localhost")
    assert beyond_loopback("0.0.0.0") and beyond_loopback("::") and beyond_loopback("node1.cluster")
