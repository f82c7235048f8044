"""miles' session server (`--use-session-server`, v1) as a service of the coordinator, over the rollout's
dispatcher: token in, token out for agents that talk to the policy through the OpenAI chat API.

Owns `SessionServer` and its routes (miles' `setup_session_routes`): `POST /sessions`, `GET` / `DELETE
/sessions/{id}`, `POST /sessions/{id}/v1/chat/completions` (the prompt rendered here — `coordinator.sessions
.tito` — and sent to the engine as `input_ids` with logprobs and meta info forced; request and response
recorded; the engine's JSON passed back, as SSE when the agent asked to stream), `POST /sessions/{id}/samples`
(the trajectory as a sample's fields), `/sessions/{id}/<path>` proxied to the session's engine when the path
is one of the engine's generation or read routes (`workers.boundary.engine_routes.agent_may_call`: the
OpenAI, Anthropic and /generate routes, /v1/models, tokenize, model info) and refused with a 403 otherwise
(pause, continue, abort, flush, memory, weight updates, /server_info: the coordinator's alone), and
`GET /health`. A chat request's messages are bounded each (413 past `max_message_bytes`) and may not bring a
chat template of their own (400) (`workers.boundary.chat_requests`). On a vision-language policy a chat request's
image_url parts (data URLs only) are decoded under the boundary's bounds, rendered by the template, expanded in the
prompt ids and sent as `image_data` (`coordinator.sessions.images`). The HTTP side (bounded connections, heads
and bodies, deadlines, the API key of `--sglang-api-key`) is the shared layer's (`workers.boundary
.http_server`), behind the hook endpoint's gates.

Invariants: every call of one session goes to one engine, picked when the session is created (another one only
after the dispatcher's fleet found it dead), the router bypassed (it drops `input_ids` and `return_meta_info`)
unless the run knows no engine but the router's address; an agent reaches no control route of an engine
(miles' server proxies every path; this one keeps an allow-list); a session's calls run one at a time (its
lock); at most `max_sessions` sessions live at once (503 beyond); an engine's 4xx reaches the agent with its
status and is not recorded, so the agent can retry.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import anyio
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp

from coordinator.engines.bounded import chat_reply_limit
from coordinator.engines.errors import EngineError, EngineHTTPError, EngineReplyError
from coordinator.engines.replies import check_chat_reply
from coordinator.rollout.dispatch import Dispatcher, EngineHandleLike, NoEngineAvailable
from coordinator.rollout.hook_endpoint import ENGINE_HEADER, guarded
from coordinator.sessions.images import decode_urls, expand_image_runs, image_urls, template_messages
from coordinator.sessions.tito import Matcher, SessionRequestError, TitoTokenizer
from coordinator.sessions.trajectory import Session, SessionBounds, SessionFull, assemble_all
from coordinator.sessions.wire_formats import (
    MESSAGES_PATH,
    RESPONSES_PATH,
    FormatCall,
    FormatError,
    finished_turn,
    messages_call,
    responses_call,
    stored_reply,
)
from workers.boundary.chat_requests import MAX_MESSAGE_BYTES, oversized_message, request_template
from workers.boundary.engine_routes import agent_may_call
from workers.boundary.errors import BoundaryError
from workers.boundary.http_gates import BodyTooLarge, HttpReply, read_body, reply_handler
from workers.boundary.http_guard import ServerLimits
from workers.boundary.http_server import AppServer
from workers.boundary.json_input import JsonLimits, JsonObject, JsonValue, decode_json_async
from workers.engine.finished_turns import Turn as FinishedTurn

if TYPE_CHECKING:
    from workers.vlm_processor import PixelInputs, VlmProcessor

log = logging.getLogger(__name__)

CHAT_PATH = "v1/chat/completions"
#: the structured formats a session serves over the same turn core as chat completions
FORMATS: dict[str, Callable[[Any, str, bool], FormatCall]] = {MESSAGES_PATH: messages_call,
                                                               RESPONSES_PATH: responses_call}


def _json(body: JsonValue) -> bytes:
    return json.dumps(body, separators=(",", ":")).encode()


def _sse(response: JsonObject) -> bytes:
    """The engine's whole answer as one `chat.completion.chunk` and [DONE] (miles' fake streaming: the engine
    call is not streamed, since the session needs the complete message and meta info). As miles: one delta
    with the role and content (and reasoning / tool calls, each with its index), the usage; and the logprobs."""
    choice = response.get("choices", [{}])[0]
    message = choice.get("message") or {}
    delta = {"role": message.get("role", "assistant"), "content": message.get("content")}
    if message.get("reasoning_content") is not None:
        delta["reasoning_content"] = message["reasoning_content"]
    if message.get("tool_calls"):
        delta["tool_calls"] = [{**call, "index": i} for i, call in enumerate(message["tool_calls"])]
    chunk = {"id": response.get("id"), "object": "chat.completion.chunk", "created": response.get("created"),
             "model": response.get("model"),
             "choices": [{"index": 0, "delta": delta, "logprobs": choice.get("logprobs"),
                          "finish_reason": choice.get("finish_reason")}]}
    if response.get("usage") is not None:
        chunk["usage"] = response["usage"]
    return b"data: " + _json(chunk) + b"\n\ndata: [DONE]\n\n"


METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE"]


class SessionServer(AppServer):
    """The session routes over the rollout's dispatcher. `await task_group.start(server.run)` listens."""

    DESCRIPTION = "session server (/sessions for agents on the OpenAI API, over the rollout's dispatcher)"

    def __init__(self, *, dispatcher: Dispatcher, tito: TitoTokenizer, matcher: Matcher, api_key: str | None = None,
                 host: str = "127.0.0.1", port: int = 0, max_sessions: int = 65536,
                 max_body_bytes: int = 64 * 1024 * 1024, max_message_bytes: int = MAX_MESSAGE_BYTES,
                 limits: ServerLimits | None = None, session_bounds: SessionBounds | None = None,
                 vision: VlmProcessor | None = None) -> None:
        super().__init__(host=host, port=port, limits=limits or ServerLimits())
        self.vision = vision  # a vision-language policy: its processor (docs/vlm.md, `coordinator.sessions.images`)
        tito.message_parts = template_messages if vision is not None else None
        self.max_message_bytes = max_message_bytes
        self.dispatcher = dispatcher
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes
        self.requests = 0
        self.tito = tito
        self.matcher = matcher
        self.max_sessions = max_sessions
        self.session_bounds = session_bounds or SessionBounds()
        self.sessions: dict[str, Session] = {}
        # Straight to the engines whenever the run knows them, with a router too: sglang-router re-serialises
        # chat requests and drops SGLang's `input_ids` and `return_meta_info`, which token-in-token-out needs.
        self.direct = dispatcher.pool is not None

    # --- in-process API (the agentic generate uses it; the routes below are the same calls over HTTP) --------
    async def create(self, engine: EngineHandleLike | None = None) -> Session:
        """A new session on `engine` (the prompt group's, for its prefix cache) when it is alive, else on the
        least loaded one."""
        if len(self.sessions) >= self.max_sessions:
            raise HttpReply(503, f"the session server holds its limit of {self.max_sessions} sessions")
        session = Session(bounds=self.session_bounds)
        if self.direct:
            if engine is not None and getattr(engine, "alive", True):
                session.engine = engine
                self.dispatcher.assigned[engine.url] += 1
            else:
                session.engine = await self._pick()
        self.sessions[session.id] = session
        return session

    def get(self, session_id: str) -> Session:
        session = self.sessions.get(session_id)
        if session is None or session.closed:
            raise HttpReply(404, f"session not found: session_id={session_id}")
        session.touched = time.monotonic()
        return session

    async def reap(self, idle_since: float) -> int:
        """Delete the sessions no agent called since `idle_since` (a rollout's start, at its end): a session a
        generate function opened and never closed. Their turns are dropped: a sample is what an agent asked
        `/samples` (or the agentic generate) for. Returns how many."""
        stale = [s.id for s in self.sessions.values() if s.touched < idle_since and not s.lock.locked()]
        for session_id in stale:
            if session_id in self.sessions:
                await self.delete(session_id)
        if stale:
            log.warning("reaped %d session(s) left open since before the rollout began", len(stale))
        return len(stale)

    async def delete(self, session_id: str) -> None:
        session = self.get(session_id)
        session.closed = True
        async with session.lock:  # an in-flight chat finishes first
            self.sessions.pop(session_id, None)
            if session.engine is not None:
                self.dispatcher.assigned[session.engine.url] -= 1

    # --- routes -------------------------------------------------------------------------------------------
    def app(self) -> ASGIApp:
        app = Starlette(routes=[Route("/{path:path}", self._route, methods=METHODS)],
                        exception_handlers={HttpReply: reply_handler})
        return guarded(app, max_body_bytes=self.max_body_bytes, api_key=self.api_key)

    async def _route(self, request: Request) -> Response:
        status, data, served_by = await self._respond(request)
        kind = "text/event-stream" if data.startswith((b"data: ", b"event: ")) else "application/json"
        return Response(data, status_code=status, media_type=kind,
                        headers={ENGINE_HEADER: served_by} if served_by else None)

    async def _respond(self, request: Request) -> tuple[int, bytes, str | None]:
        self.requests += 1
        path, query, method = request.url.path, request.url.query, request.method
        parts = [part for part in path.split("/") if part]
        if parts == ["health"]:
            return 200, b'{"status":"ok"}', None
        if parts == ["sessions"] and method == "POST":
            return 200, _json({"session_id": (await self.create()).id}), None
        if len(parts) < 2 or parts[0] != "sessions":
            raise HttpReply(404, f"{path}: the session server serves /sessions, /sessions/{{id}}[/...] and /health")
        session_id, rest = parts[1], "/".join(parts[2:])
        if not rest:
            if method == "GET":
                return 200, _json(self._describe(self.get(session_id))), None
            if method == "DELETE":
                await self.delete(session_id)
                return 200, b"{}", None
            raise HttpReply(405, f"{method} {path}: use GET or DELETE")
        if rest == "samples" and method == "POST":
            return 200, _json(self._samples(self.get(session_id), await self._body(request))), None
        if rest == CHAT_PATH and method == "POST":
            return await self._chat(self.get(session_id), await self._body(request))
        if rest in FORMATS and method == "POST":
            return await self._format(self.get(session_id), await self._body(request), FORMATS[rest])
        session = self.get(session_id)
        if not agent_may_call("/" + rest, method):
            raise HttpReply(403, f"{method} /{rest}: an agent's session may call the engine's generation routes "
                            "only (/v1/chat/completions, /v1/completions, /v1/messages, /v1/responses, /generate, "
                            "/v1/models, tokenize, model info); control routes are the coordinator's")
        payload = await self._body(request, proxied=True)
        self._check_chat(payload)
        return await self._proxy(session, method, rest + (f"?{query}" if query else ""), payload)

    async def _body(self, request: Request, *, proxied: bool = False) -> JsonValue:
        """The request's JSON object, bounded by the shared decoder; no body is {} (None when `proxied`)."""
        try:
            body = await read_body(request, self.max_body_bytes)
            if not body.strip():
                return None if proxied else {}
            value = await decode_json_async(body, "request body", JsonLimits(max_bytes=self.max_body_bytes))
        except BodyTooLarge as error:
            raise HttpReply(413, str(error)) from None
        except BoundaryError as error:
            raise HttpReply(400, f"invalid JSON body: {error.reason}") from None
        if not isinstance(value, dict):
            raise HttpReply(400, "the body must be a JSON object")
        return value

    def _describe(self, session: Session) -> JsonObject:
        return {"session_id": session.id, "records": session.describe(),
                "metadata": {"accumulated_token_ids": session.token_ids, "max_trim_tokens": 0}}

    def _samples(self, session: Session, body: JsonObject) -> JsonObject:
        limit = body.get("max_seq_len")
        if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 1):
            raise HttpReply(400, f"max_seq_len must be a positive integer, got {limit!r}")
        try:
            assembled = assemble_all(session, max_seq_len=limit)
        except ValueError as error:
            raise HttpReply(422, str(error)) from None
        if not assembled:
            reason = "no_records" if not session.turns else "all_truncated"
            return {"samples": [], "empty_reason": reason}
        return {"samples": [vars(one) | {"status": one.status.value} for one in assembled], "empty_reason": None}

    # --- chat -----------------------------------------------------------------------------------------------
    def _check_chat(self, request: JsonObject | None) -> None:
        """A request's messages within the per-message limit (413) and no template of its own (400): the
        policy's prompts are rendered with the model's template."""
        if not request:
            return
        if (reason := oversized_message(request.get("messages"), self.max_message_bytes)) is not None:
            raise HttpReply(413, reason)
        if request_template(request) is not None:
            raise HttpReply(400, "a session renders its prompts with the model's chat template: a request may "
                            "not bring its own ('chat_template' / chat_template_kwargs.chat_template)")

    async def _chat(self, session: Session, request: dict[str, Any]) -> tuple[int, bytes, str | None]:
        stream = bool(request.pop("stream", False))
        request.pop("stream_options", None)
        response, url = await self._run_turn(session, request)
        return 200, (_sse(response) if stream else _json(response)), url

    async def _format(self, session: Session, body: dict[str, Any],
                      build: Callable[[Any, str, bool], FormatCall]) -> tuple[int, bytes, str | None]:
        """A Messages or Responses request run as the session's chat turn and answered in its own format (its
        image blocks / input_image parts as image_url parts when the policy is a vision-language model)."""
        try:
            call = build(body, str(body.get("model") or "rayless"), self.vision is not None)
        except FormatError as error:
            raise HttpReply(400, str(error)) from None
        turns: list[FinishedTurn] = []

        def structured(response: dict[str, Any]) -> dict[str, Any]:
            turns.append(finished_turn(response, call.tool_names, meta_info=call.meta_info))
            return stored_reply(turns[-1])

        _, url = await self._run_turn(session, call.chat_body, reply_of=structured)
        if call.stream:
            return 200, "".join([event async for event in call.events(turns[0])]).encode(), url
        return 200, call.answer(turns[0]), url

    async def _run_turn(self, session: Session, request: dict[str, Any],
                        reply_of: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
                        ) -> tuple[dict[str, Any], str]:
        """One turn of the session: the prompt built from its tree, the engine's answer checked and recorded
        (its assistant message as `reply_of` gives it, else the chat reply's message)."""
        self._check_chat(request)
        messages = request.get("messages")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise HttpReply(400, "'messages' must be a non-empty list of message objects")
        if request.get("n", 1) not in (1, None):
            raise HttpReply(400, "a session records one trajectory: n must be 1")
        tools = request.get("tools")
        urls, pixels = await self._images(messages)
        # What token-in-token-out needs, forced (as miles): the session's ids, logprobs, and the meta info.
        request.update(logprobs=True, return_meta_info=True, no_stop_trim=False)
        async with session.lock:
            if session.closed:
                raise HttpReply(404, f"session not found: session_id={session.id}")
            if len(session.turns) >= session.bounds.max_turns:
                raise HttpReply(413, f"the session holds its limit of {session.bounds.max_turns} turns")
            try:
                request["input_ids"], mount = session.prompt_ids(messages, tools, self.tito, self.matcher)
                if self.vision is not None:
                    request["input_ids"] = expand_image_runs(request["input_ids"], pixels, self.vision)
                if urls:
                    request["image_data"] = urls  # SGLang's field: the prompt's images, in order
            except SessionRequestError as error:
                raise HttpReply(400, str(error)) from None
            response, url = await self._engine_call(session, "POST", CHAT_PATH, request)
            request.pop("image_data", None)  # kept once, in the messages of the session's tree
            try:  # the turn's ids and logprobs are trained on: refused if out of the vocabulary or not finite
                check_chat_reply(response, url, self.dispatcher.client.vocab_size)
            except EngineReplyError as error:
                self.dispatcher.refused[url] += 1
                raise HttpReply(502, str(error)) from None
            prompt_ids = request.pop("input_ids")
            del request["messages"]  # both kept once, in the session (`Session.describe` puts them back)
            record = {"method": "POST", "path": "/v1/chat/completions", "status_code": 200, "request": request,
                      "response": response}
            fields = self._turn(response)
            if reply_of is not None:
                fields["reply"] = reply_of(response)
            try:
                session.record(kept=mount, prompt_ids=prompt_ids, messages=messages, record=record, **fields)
            except SessionFull as error:
                raise HttpReply(413, str(error)) from None
        return response, url

    async def _images(self, messages: list[JsonObject]) -> tuple[list[str], PixelInputs | None]:
        """A VLM session's request: its image parts' data URLs and their pixel inputs (decoded off the loop,
        under the boundary's bounds; 400 naming a bad one); ([], None) without images or on a text policy (whose
        template rendering refuses image parts)."""
        if self.vision is None:
            return [], None
        vision = self.vision
        try:
            urls = image_urls(messages)
            if not urls:
                return [], None
            pixels = await anyio.to_thread.run_sync(lambda: vision.pixel_inputs(decode_urls(urls)))
        except SessionRequestError as error:
            raise HttpReply(400, str(error)) from None
        return urls, pixels

    @staticmethod
    def _turn(response: JsonObject) -> JsonObject:
        """What a turn keeps of the engine's answer: the reply message, generated ids and their logprobs."""
        try:
            choice = response["choices"][0]
            meta = choice["meta_info"]
            pairs = meta["output_token_logprobs"]
            message = dict(choice["message"])
        except (KeyError, IndexError, TypeError):
            raise HttpReply(502, "the engine's chat answer has no choices[0].meta_info.output_token_logprobs "
                              "(it must serve SGLang's return_meta_info)") from None
        if len(pairs) != meta.get("completion_tokens", len(pairs)):
            raise HttpReply(502, f"the engine answered {len(pairs)} output logprobs for "
                              f"{meta.get('completion_tokens')} completion tokens")
        reply = {key: value for key, value in message.items() if value is not None}
        reply.setdefault("content", "")
        return {"reply": reply, "output_ids": [int(p[1]) for p in pairs], "logprobs": [float(p[0]) for p in pairs],
                "finish": choice.get("finish_reason"), "weight_version": meta.get("weight_version")}

    async def _proxy(self, session: Session, method: str, path: str,
                     payload: JsonObject | None) -> tuple[int, bytes, str | None]:
        response, url = await self._engine_call(session, method, path, payload)
        return 200, _json(response), url

    async def _engine_call(self, session: Session, method: str, path: str,
                           body: JsonObject | None) -> tuple[JsonValue, str]:
        """One call on the session's engine; if it died (the fleet confirms), once more on another."""
        client, dispatcher = self.dispatcher.client, self.dispatcher
        headers = {"X-SMG-Routing-Key": session.id}
        for attempt in (1, 2):
            if self.direct and session.engine is None:  # its engine died, none was left
                session.engine = await self._pick()
            url = session.engine.url if self.direct else str(dispatcher.router_url)
            try:
                answer = await client.request_json(url, method, "/" + path, json_body=body, headers=headers,
                                                   timeout=client.generate_timeout, max_bytes=chat_reply_limit(body))
                return answer, url
            except EngineHTTPError as error:
                if error.status < 500:
                    raise HttpReply(error.status, error.server_message) from None
                failure: EngineError = error
            except EngineError as error:
                failure = error
            if not self.direct or attempt == 2 or await self.dispatcher.pool.check(session.engine):
                raise HttpReply(502, str(failure)) from None
            await self._move(session, failure)
        raise AssertionError("unreachable")

    async def _move(self, session: Session, failure: EngineError) -> None:
        assert self.dispatcher.pool is not None
        self.dispatcher.pool.mark_dead(session.engine, f"a session call failed ({failure}) and it did not answer")
        self.dispatcher.assigned[session.engine.url] -= 1
        dead, session.engine = session.engine.url, None
        session.engine = await self._pick(exclude={dead})
        log.warning("session %s moved from engine %s to %s", session.id, dead, session.engine.url)

    async def _pick(self, exclude: set[str] | None = None) -> EngineHandleLike:
        try:
            handle = await self.dispatcher.pick(exclude=exclude)
        except NoEngineAvailable as error:
            raise HttpReply(503, str(error)) from None
        self.dispatcher.assigned[handle.url] += 1
        return handle
