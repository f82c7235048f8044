"""Which of an SGLang engine's routes a client of each kind may call: the one table the engine's auth, the
coordinator's engine client and the session server read.

Owns `route_kind` (a path → `open` / `generate` / `read` / `admin`), `is_admin` and `agent_may_call` (a path
and a method). The kinds:
- `open`: health probes and metrics, answered without a key (SGLang's `decide_request_auth`);
- `generate`: generation and what it needs to read (`/generate`, the OpenAI routes, tokenize/detokenize,
  `/v1/models`): SGLang's `NORMAL` level, the `--api-key`;
- `read`: the model's and the weights' description (`/model_info`, `/get_weight_version`): `NORMAL` too;
- `admin`: everything else — pause / continue / abort, flush, memory release and resume, every weight update,
  `/server_info` (it holds the engine's arguments) and any path not named here: SGLang's `ADMIN_OPTIONAL`
  level, asked for the `--admin-api-key` when one is set (then the `--api-key` does not open them), else for
  the `--api-key`.

Invariant: the table is an allow-list — a path not named is `admin`, so a route added to the engine later is
closed to agents until someone names it here.
"""

from __future__ import annotations

from typing import Literal

RouteKind = Literal["open", "generate", "read", "admin"]

#: generation, and what an agent needs to generate: path → the methods that generate
GENERATE: dict[str, frozenset[str]] = {
    "/generate": frozenset({"POST"}),
    "/v1/chat/completions": frozenset({"POST"}),
    "/v1/completions": frozenset({"POST"}),
    "/v1/messages": frozenset({"POST"}),  # Anthropic's API, as SGLang serves it
    "/v1/messages/count_tokens": frozenset({"POST"}),
    "/v1/responses": frozenset({"POST"}),
    "/v1/models": frozenset({"GET"}),
    "/v1/tokenize": frozenset({"POST"}),
    "/v1/detokenize": frozenset({"POST"}),
    "/tokenize": frozenset({"POST"}),
    "/detokenize": frozenset({"POST"}),
}

#: read-only descriptions an agent may need (never the engine's arguments: `/server_info` is admin)
READ: dict[str, frozenset[str]] = {
    "/model_info": frozenset({"GET"}),
    "/get_model_info": frozenset({"GET"}),
    "/get_weight_version": frozenset({"GET"}),
    "/weight_version": frozenset({"GET"}),
}


def is_open(path: str) -> bool:
    """Paths SGLang answers without any key: health and readiness probes, metrics."""
    return path.startswith(("/health", "/ready", "/metrics"))


def _methods(path: str) -> tuple[RouteKind, frozenset[str]] | None:
    """The kind of a named path and the methods an agent may use on it; None for a path not named."""
    for table, kind in ((GENERATE, "generate"), (READ, "read")):
        if path in table:
            return kind, table[path]  # type: ignore[return-value]
    if path.startswith("/v1/models/"):  # one model's card
        return "generate", GENERATE["/v1/models"]
    if path.startswith("/v1/responses/") and not path.endswith("/cancel"):
        return "generate", frozenset({"GET"})  # a stored response read back; cancelling one is control
    return None


def route_kind(path: str) -> RouteKind:
    """The kind of a path (without its query string), whatever the method: what the engine's auth asks."""
    if is_open(path):
        return "open"
    named = _methods(path)
    return "admin" if named is None else named[0]


def is_admin(path: str) -> bool:
    """Whether `path` is a control route (the admin key's, when the engines have one)."""
    return route_kind(path.split("?", 1)[0]) == "admin"


def agent_may_call(path: str, method: str) -> bool:
    """Whether an agent (the session server's client) may have `method path` forwarded to its engine: the
    generation and read routes only, with their methods; health is the session server's own."""
    named = _methods(path.split("?", 1)[0])
    return named is not None and method.upper() in named[1]
