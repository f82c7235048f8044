"""What a run gives slime-style hooks: their `args`, slime's `GenerateState`, the address they post to, and
the route of each hook call through our dispatch.

Owns `HookRuntime` (one per run, built by the rollout manager; the run opens it, which opens the HTTP client
`post` uses, and binds the address once the endpoint — or the router — is known), `HookRoutes` (the routes of
the hook calls in flight: which engine a prompt group sticks to, and the seed of each request), the
context of one hook call (`hook_call`), and `SlimeGenerateState`, exported as `coordinator.hooks.GenerateState`.

Invariants: a route exists exactly while its hook call runs (`HookRoutes.open` is a context manager), so the
registry holds at most one entry per sample in flight; the engines' API key travels only to the run's own
address (the endpoint or the router), never to another service a hook posts to.
"""

from __future__ import annotations

import argparse
import secrets
from collections.abc import AsyncGenerator, Iterator
from contextlib import AbstractAsyncContextManager, AsyncExitStack, asynccontextmanager, contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol
from urllib.parse import urlsplit

import anyio

from workers.errors import RaylessError

if TYPE_CHECKING:
    from coordinator.engines.client import EngineClient

#: Header naming the route of a hook's request (set by `post` on requests to the run's own address).
ROUTE_HEADER = "X-Rayless-Route"


class HookError(RaylessError, RuntimeError):
    """A hook broke its contract, or used the hook API outside what a run gives it."""


@dataclass
class GroupRoute:
    """One prompt group's place in dispatch: the engine it sticks to (None: any; with a router: the router's
    choice) and what a request's seed is made of."""

    rollout_id: int
    group_index: int
    engine: Any = None


@dataclass(frozen=True)
class Route:
    group: GroupRoute
    sample_index: int


class HookRoutes:
    """The routes of hook calls in flight, by the token `post` sends in `ROUTE_HEADER`."""

    def __init__(self) -> None:
        self._routes: dict[str, Route] = {}

    def __len__(self) -> int:
        return len(self._routes)

    @contextmanager
    def open(self, route: Route) -> Iterator[str]:
        token = secrets.token_hex(12)
        self._routes[token] = route
        try:
            yield token
        finally:
            del self._routes[token]

    def get(self, token: str | None) -> Route | None:
        return self._routes.get(token) if token else None


class Slots(Protocol):
    """The run's bound on requests in flight (`coordinator.rollout.requests.RequestSlots`)."""

    free: int

    def hold(self, count: int) -> AbstractAsyncContextManager[None]: ...


class RequestSemaphore:
    """slime's `GenerateState.semaphore`: `async with` holds one of the run's request slots (the bound the
    default generate path and evaluation share), so hooks stay within `--sglang-server-concurrency`."""

    def __init__(self, slots: Slots) -> None:
        self._slots = slots
        self._held: list[AsyncExitStack] = []

    async def __aenter__(self) -> RequestSemaphore:
        stack = AsyncExitStack()
        await stack.enter_async_context(self._slots.hold(1))
        self._held.append(stack)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._held.pop().aclose()

    @property
    def free(self) -> int:
        return self._slots.free


class SlimeGenerateState:
    """slime's `GenerateState(args)`: `tokenizer`, `sampling_params` (slime's defaults), `semaphore`, `args`.

    `GenerateState(args)` returns the run's one state (as slime's singleton does), looked up from the `args`
    the run gave the hook; any other `args` is a HookError saying so.
    """

    tokenizer: Any
    processor: Any
    sampling_params: dict[str, Any]
    semaphore: RequestSemaphore
    args: argparse.Namespace

    def __new__(cls, args: Any = None) -> SlimeGenerateState:
        runtime = getattr(args, "_rayless_runtime", None)
        if runtime is None:
            raise HookError("GenerateState(args) needs the args rayless passes to a hook (hooks get them as "
                            "their first argument)")
        return runtime.generate_state

    def __init__(self, args: Any = None) -> None:  # built by `_build`; calling it again changes nothing
        pass

    @classmethod
    def _build(cls, *, args: argparse.Namespace, tokenizer: Any, sampling_params: dict[str, Any],
               slots: Slots) -> SlimeGenerateState:
        state = object.__new__(cls)
        state.args = args
        state.tokenizer = tokenizer
        state.processor = None
        state.sampling_params = dict(sampling_params)
        state.semaphore = RequestSemaphore(slots)
        return state


class HookRuntime(anyio.AsyncContextManagerMixin):
    """The run's hook facilities. `args._rayless_runtime` points back here (that is how `GenerateState(args)`
    and `post` find the run).

    Args:
        args: the hooks' `args` (`coordinator.hooks.args.build_hook_args`).
        api_key: the engines' key (`--sglang-api-key`): sent by `post` to the run's own address only.
    """

    def __init__(self, *, args: argparse.Namespace, api_key: str | None = None) -> None:
        self.args = args
        self.api_key = api_key
        self.routes = HookRoutes()
        self.http: EngineClient | None = None
        self._state: SlimeGenerateState | None = None
        self.sessions: Any = None  # the session server (coordinator.sessions.server), with --use-session-server
        args.__dict__["_rayless_runtime"] = self

    # --- pieces -------------------------------------------------------------------------------------------
    def attach_generate_state(self, *, tokenizer: Any, sampling_params: dict[str, Any],
                              slots: Slots, processor: object = None) -> None:
        self._state = SlimeGenerateState._build(args=self.args, tokenizer=tokenizer,
                                                sampling_params=sampling_params, slots=slots)
        # slime's GenerateState.processor: the model's (a VLM's `VlmProcessor`), None for a text model
        self._state.processor = processor

    @property
    def generate_state(self) -> SlimeGenerateState:
        if self._state is None:
            raise HookError("GenerateState is not built in this run: it starts no engines "
                            "(--debug-train-only or --load-debug-rollout-data)")
        return self._state

    # --- the address hooks post to ------------------------------------------------------------------------
    def bind_address(self, host: str, port: int) -> None:
        """`args.sglang_router_ip/port`: the coordinator's endpoint, or the router the run uses."""
        self.args.sglang_router_ip = host
        self.args.sglang_router_port = port

    @property
    def address(self) -> tuple[str, int] | None:
        host, port = getattr(self.args, "sglang_router_ip", None), getattr(self.args, "sglang_router_port", None)
        return (str(host), int(port)) if host is not None and port is not None else None

    def is_own_address(self, url: str) -> bool:
        address = self.address
        if address is None:
            return False
        parts = urlsplit(url)
        return (parts.hostname, parts.port) == address

    # --- the HTTP client `post` uses ----------------------------------------------------------------------
    @asynccontextmanager
    async def __asynccontextmanager__(self) -> AsyncGenerator[HookRuntime]:
        from coordinator.engines.client import EngineClient
        from coordinator.engines.policy import RetryPolicy

        # No API key on the client: hooks post to other services too; `post` adds it for our address only.
        async with EngineClient(max_connections=256, retry=RetryPolicy(attempts=3, budget=60.0)) as client:
            self.http = client
            try:
                yield self
            finally:
                self.http = None


@dataclass
class GenerateFnInput:
    """miles' `GenerateFnInput`, for generate functions of miles' form `async fn(input)`."""

    state: Any
    sample: Any
    sampling_params: dict[str, Any]
    evaluation: bool
    args: Any


@dataclass
class GenerateFnOutput:
    """miles' `GenerateFnOutput`: the sample (or samples) a miles-form generate function returns."""

    samples: Any


@dataclass(frozen=True)
class HookCall:
    """The context of one hook call: the run, and the route of its requests (None: dispatch picks)."""

    runtime: HookRuntime
    route_token: str | None = None


_CURRENT: ContextVar[HookCall | None] = ContextVar("rayless_hook_call", default=None)


@contextmanager
def hook_call(runtime: HookRuntime, route_token: str | None = None) -> Iterator[None]:
    """Run a hook inside this: its `post` calls to our address carry the route (and the API key)."""
    reset = _CURRENT.set(HookCall(runtime, route_token))
    try:
        yield
    finally:
        _CURRENT.reset(reset)


def current_call() -> HookCall | None:
    return _CURRENT.get()
