"""What agents can reach (issue 40), as properties of the pieces every agent-facing server shares:

- the route table: each of our engine's routes has a kind; an agent may call the generation and read routes
  only, with their methods; a path nobody named is a control route;
- SGLang's two keys, on a real server: a control route takes the admin key when one is set (the API key no
  longer opens it), else the API key; a generation route takes the API key; health is open — SGLang's
  `decide_request_auth` table, case by case;
- a message's size is bounded in UTF-8 bytes, parts and tool calls included; a request's own template is
  found under either spelling;
- a request's template renders in the sandbox, `*` and `**` bounded, and is stopped at its deadline, the
  worker thread it ran on serving the next call as usual.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import anyio
import httpx
import pytest
from anyio.from_thread import start_blocking_portal
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from workers.boundary.chat_requests import oversized_message, request_template
from workers.boundary.engine_routes import agent_may_call, is_admin, route_kind
from workers.boundary.http_gates import AdminKeyMiddleware
from workers.boundary.http_server import HttpService
from workers.engine.chat_template import TemplateRefused, bounded, render_request_template
from workers.engine.control_routes import ControlRoutes
from workers.engine.generate_routes import GenerateRoutes
from workers.engine.info_routes import InfoRoutes
from workers.engine.memory_routes import MemoryRoutes
from workers.engine.openai_routes import OpenAIRoutes
from workers.engine.weight_routes import WeightRoutes

API, ADMIN = "agents-key-3f", "admin-key-8d"


def engine_routes() -> dict[str, set[str]]:
    modules = (ControlRoutes, GenerateRoutes, InfoRoutes, MemoryRoutes, WeightRoutes, OpenAIRoutes)
    return {route.path: set(route.methods or ()) - {"HEAD"}
            for module in modules for route in module(None).routes()}  # type: ignore[arg-type]


def test_every_engine_route_has_a_kind_and_agents_reach_generation_only() -> None:
    routes = engine_routes()
    agents = {(method, path) for path, methods in routes.items() for method in methods if agent_may_call(path, method)}
    assert agents == {("POST", "/generate"), ("POST", "/v1/chat/completions"), ("POST", "/v1/completions"),
                      ("GET", "/v1/models"), ("GET", "/model_info"), ("GET", "/get_model_info"),
                      ("GET", "/get_weight_version"), ("GET", "/weight_version")}
    control = {path for path in routes if route_kind(path) == "admin"}
    assert control == {"/flush_cache", "/abort_request", "/pause_generation", "/continue_generation",
                       "/release_memory_occupation", "/resume_memory_occupation", "/update_weight_version",
                       "/update_weights_from_disk", "/init_weights_update_group", "/update_weights_from_distributed",
                       "/destroy_weights_update_group", "/begin_weight_update", "/end_weight_update",
                       "/server_info", "/get_server_info", "/get_weights_by_name"}  # weights read back: control
    assert {path for path in routes if route_kind(path) == "open"} == {"/health", "/health_generate", "/metrics"}
    # a path nobody named (an SGLang route this engine lacks, a future one) is control
    for path in ("/update_weights_from_tensor", "/set_internal_state", "/v1/responses/r1/cancel", "/x"):
        assert is_admin(path) and not agent_may_call(path, "POST")
    assert agent_may_call("/v1/responses/r1", "GET") and agent_may_call("/v1/models/m?x=1", "GET")
    assert not agent_may_call("/generate", "GET") and not agent_may_call("/health", "GET")


async def ok(_request: Request) -> Response:
    return JSONResponse({})


KEYS = [(None, None), (API, None), (None, ADMIN), (API, ADMIN)]


@pytest.fixture(scope="module")
def servers() -> Iterator[dict[tuple[str | None, str | None], str]]:
    routes = [Route(path, ok, methods=["GET", "POST"]) for path in ("/health", "/generate", "/pause_generation")]
    with start_blocking_portal() as portal:
        urls, running = {}, []
        for api, admin in KEYS:
            app = AdminKeyMiddleware(Starlette(routes=routes), api_key=api, admin_api_key=admin, is_admin=is_admin)
            future, service = portal.start_task(HttpService(app=app).run)
            running.append(future)
            urls[(api, admin)] = service.url
        try:
            yield urls
        finally:
            for future in running:
                future.cancel()


def sglang_decision(api: str | None, admin: str | None, path: str, sent: str | None) -> int:
    """SGLang's `decide_request_auth` (python/sglang/srt/utils/auth.py) for NORMAL and ADMIN_OPTIONAL routes."""
    if path == "/health":
        return 200
    if path == "/pause_generation":  # ADMIN_OPTIONAL
        expected = admin or api
    else:  # NORMAL: the API key when one is set (the admin key does not open it), else open
        expected = api
    return 200 if expected is None or sent == expected else 401


@pytest.mark.parametrize(("api", "admin"), KEYS)
@pytest.mark.parametrize("path", ["/health", "/generate", "/pause_generation"])
@pytest.mark.parametrize("sent", [None, API, ADMIN, "wrong"])
def test_two_keys_as_sglang_decides(servers: dict[Any, str], api: str | None, admin: str | None, path: str,
                                    sent: str | None) -> None:
    headers = {"Authorization": f"Bearer {sent}"} if sent else {}
    answer = httpx.post(servers[(api, admin)] + path, headers=headers, timeout=10)
    assert answer.status_code == sglang_decision(api, admin, path, sent)
    if answer.status_code == 401:
        assert answer.json() == {"error": "Unauthorized"}


def test_a_message_is_bounded_in_utf8_bytes_with_its_parts_and_tool_calls() -> None:
    assert oversized_message([{"role": "user", "content": "é" * 5}], 10) is None  # 10 bytes
    assert "messages[0]" in (oversized_message([{"role": "user", "content": "é" * 6}], 10) or "")
    assert "messages[1]" in (oversized_message([{"role": "system", "content": "a"},
                                                {"role": "user", "content": [{"type": "text", "text": "x" * 6},
                                                                             {"type": "text", "text": "y" * 6}]}],
                                               10) or "")
    call = {"function": {"name": "f", "arguments": "z" * 20}}
    assert oversized_message([{"role": "assistant", "content": None, "tool_calls": [call]}], 10) is not None
    assert oversized_message([{"role": "user", "content": "x" * (30 << 20)}]) is not None  # the 8 MiB default
    assert oversized_message("not a list") is None


def test_a_request_template_under_either_spelling() -> None:
    assert request_template({"chat_template": "a"}) == "a"
    assert request_template({"chat_template_kwargs": {"chat_template": "b"}}) == "b"
    assert request_template({"chat_template_kwargs": {"enable_thinking": False}}) is None


MESSAGES = [{"role": "user", "content": "hi"}]


def render(template: str) -> str:
    return render_request_template(template, MESSAGES, add_generation_prompt=True)


@pytest.mark.parametrize(("template", "words"), [
    ("{{ 'x' * 10**10 }}", "repetition"),  # refused while compiling: Jinja folds constants
    ("{{ [1] * 10**7 }}", "repetition"),
    ("{{ 2 ** 10000000 }}", "power"),
    ("{{ range(10**10) | list }}", "MAX_RANGE"),
    ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "unsafe"),
    ("{{ raise_exception('no') }}", "no"),
])
def test_a_request_template_builds_nothing_large_and_reaches_nothing_unsafe(template: str, words: str) -> None:
    with pytest.raises(TemplateRefused) as caught:
        render(template)
    assert words in str(caught.value)


async def test_a_request_template_is_stopped_at_its_deadline_and_the_worker_serves_on() -> None:
    assert await bounded(lambda: render("{% for m in messages %}{{ m.role }}={{ m.content | tojson }}{% endfor %}"
                                        "{% if add_generation_prompt %}>{% endif %}")) == 'user="hi">'
    bomb = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    with pytest.raises(TemplateRefused, match="deadline"):
        await bounded(lambda: render(bomb), deadline_s=0.2)
    with pytest.raises(TemplateRefused, match="characters"):
        await bounded(lambda: render("{% for i in range(1000) %}{{ 'x' * 1000 }}{% endfor %}"), max_chars=10_000)
    # the threads it ran on serve the next calls: no stray exception is left pending in any of them
    results = []

    async def work(n: int) -> None:
        results.append(await anyio.to_thread.run_sync(lambda: sum(range(n))))

    async with anyio.create_task_group() as tg:
        for n in range(200):
            tg.start_soon(work, 10_000 + n)
    assert sorted(results) == sorted(sum(range(10_000 + n)) for n in range(200))
