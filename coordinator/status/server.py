"""The status server: `/status` (JSON), `/metrics` (Prometheus), `/timeline.json` and the page at `/`.

Owns the HTTP side of the run's status (Starlette on the shared server layer, `workers.boundary.http_server`,
in the run's event loop) and the file
`<run_dir>/status_url`, which tells `rayless status` where to ask while the run goes on. Invariants: the socket
is bound before `task_status.started()` (a request right after start-up is answered); the run's API key guards
every path but the page (static, no data; it sends the key from the URL's `#key=` fragment, which no server
sees) and `/metrics` (SGLang's rule, the shared `ApiKeyMiddleware`); a document is built and serialised at
most every `min_interval` seconds however often it is asked for (a page polled 10 times a second builds no more
than one polled twice; the other requests are sent the bytes already made); no await holds anything the run needs; the server ends with the run and removes
its URL file.
"""

from __future__ import annotations

import logging
import time
from dataclasses import KW_ONLY, dataclass, field
from importlib import resources

import anyio
import anyio.abc
import msgspec
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from coordinator.engines.spec import engine_log_path
from coordinator.status import prometheus
from coordinator.status.host import host_facts
from coordinator.status.sources import StatusSources, snapshot
from workers.boundary.http_gates import ApiKeyMiddleware
from workers.boundary.http_guard import ServerLimits
from workers.boundary.http_server import HttpService
from workers.boundary.json_input import JsonObject

log = logging.getLogger("rayless")

URL_FILE = "status_url"


def page_html() -> str:
    return resources.files("coordinator.status").joinpath("page.html").read_text(encoding="utf-8")


@dataclass(eq=False, repr=False)
class StatusServer:
    """Start with `await task_group.start(server.run)`; `url` is known once started."""

    sources: StatusSources
    _: KW_ONLY
    host: str
    port: int
    api_key: str | None
    #: a document is built at most this often, however often it is asked for
    min_interval: float = 0.5
    documents_built: int = field(default=0, init=False)
    _document: _Built | None = field(default=None, init=False)
    _page: str = field(default_factory=page_html, init=False)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host and not self.host.startswith("[") else self.host
        return f"http://{host}:{self.port}"

    async def document(self) -> JsonObject:
        """The `/status` document, at most `min_interval` old."""
        return (await self._built()).document

    async def _built(self) -> _Built:
        cached = self._document
        if cached is not None and time.monotonic() - cached.at < self.min_interval:
            return cached
        s = self.sources
        logs = {h.name: engine_log_path(s.run_dir, h.name) for fleet in s.fleets for h in fleet.engines
                if h.launched}
        pids = {rank: info.pid for rank, info in s.train_group.ranks.items() if info.node_rank == 0} \
            if s.train_group is not None else {}
        host = await anyio.to_thread.run_sync(host_facts, logs, pids)
        document = snapshot(s, host=host)
        self._document = built = _Built(time.monotonic(), document)
        self.documents_built += 1
        return built

    def app(self) -> ASGIApp:
        async def status(request: Request) -> Response:
            return Response((await self._built()).json(), media_type="application/json")

        async def metrics(request: Request) -> Response:
            return Response((await self._built()).metrics(), media_type=prometheus.CONTENT_TYPE)

        async def timeline(request: Request) -> Response:
            return JSONResponse(self.sources.timeline.document())

        data: ASGIApp = Starlette(routes=[Route("/status", status), Route("/metrics", metrics),
                                          Route("/timeline.json", timeline)])
        if self.api_key:
            data = ApiKeyMiddleware(data, self.api_key)
        page = HTMLResponse(self._page, headers={"Cache-Control": "no-store"})

        async def app(scope: Scope, receive: Receive, send: Send) -> None:
            if scope["type"] == "http" and scope["path"] in ("/", "/index.html"):
                await page(scope, receive, send)
            else:
                await data(scope, receive, send)

        return app

    async def run(self, *, task_status: anyio.abc.TaskStatus[StatusServer] = anyio.TASK_STATUS_IGNORED) -> None:
        # served as every rayless server is: bound first, under the shared connection cap and deadlines
        service = HttpService(app=self.app(), host=self.host.strip("[]"), port=self.port, limits=ServerLimits(),
                              description="status page")
        url_file = self.sources.run_dir / URL_FILE
        async with anyio.create_task_group() as group:
            try:
                await group.start(service.run)
            except OSError as error:
                raise OSError(error.errno, f"--status-port {self.port}: {error.strerror or error}") from None
            self.port = service.port
            for fleet in self.sources.fleets:
                group.start_soon(self.sources.changes.watch, fleet, self.sources.released)
            url_file.write_text(self.url + "\n", encoding="utf-8")
            log.info("status page: %s (JSON at /status, Prometheus at /metrics)", self.url)
            task_status.started(self)
            try:
                await anyio.sleep_forever()
            finally:
                url_file.unlink(missing_ok=True)


class _Built:
    """One document and its two renderings, each made once, when first asked for."""

    def __init__(self, at: float, document: JsonObject) -> None:
        self.at = at
        self.document = document
        self._json: bytes | None = None
        self._metrics: bytes | None = None

    def json(self) -> bytes:
        if self._json is None:
            self._json = msgspec.json.encode(self.document)
        return self._json

    def metrics(self) -> bytes:
        if self._metrics is None:
            self._metrics = prometheus.render(self.document)
        return self._metrics
