"""The engine's OpenAI-compatible endpoints, as SGLang serves them: `/v1/chat/completions`,
`/v1/completions`, `/v1/models`.

Owns the handlers only: a request is mapped to a /generate body (`openai_protocol`), validated and turned
into sequences by the server's own `build` (so the bounds, the 4xx rules and the API key are those of
/generate), run by the same scheduler, and rendered (`openai_render`). Chat prompts are rendered with the
model's chat template off the event loop, in Jinja's sandbox under a deadline and an output bound
(`chat_template`); a request's own template is refused unless `--trust-request-chat-template`, and a message
over `--max-message-bytes` is a 413 before anything renders it.

Invariants: every rejection is SGLang's `ErrorResponse` (`{"object": "error", "message", "type", "code"}`)
with a 4xx status, decided before anything joins the batch; a stream is SSE (`data: {...}` events, then
`data: [DONE]`) as the openai SDK reads it, and a client that leaves mid-stream aborts its sequences.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, Protocol

import anyio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from workers.boundary.chat_requests import oversized_message, request_template
from workers.boundary.json_input import JsonObject, JsonValue
from workers.engine import openai_render as render
from workers.engine.chat_template import TemplateRefused, bounded, render_request_template
from workers.engine.http_input import read_json
from workers.engine.openai_protocol import GenerateBody, chat_request, completion_request
from workers.engine.sampling_params import RequestError
from workers.engine.sequences import MemoryReleasedError, RequestGroup, Seq

if TYPE_CHECKING:
    from workers.engine.args import EngineArgs
    from workers.engine.runner import ModelRunner
    from workers.engine.scheduler import Scheduler


class EngineCore(Protocol):
    """What the OpenAI routes use of the engine (`workers.engine.server.EngineServer`): its model, its
    request validation and rendering, and its scheduler."""

    args: EngineArgs
    runner: ModelRunner
    scheduler: Scheduler
    model_path: str
    context_length: int

    async def build(self, body: JsonObject, *, expand_images: bool = False) -> tuple[list[Seq], bool, RequestGroup]: ...

    async def expand_images(self, ids: list[int], urls: list[str]) -> list[int]: ...

    def render(self, seq: Seq, *, with_text: bool, final: bool) -> JsonObject: ...

    async def wait_or_disconnect(self, request: Request, group: RequestGroup) -> None: ...


class RequestTooLarge(RequestError):
    """A request within the body limit holding a message over the per-message limit: 413."""


def openai_error(
    message: str, status: int = 400, kind: str = "BadRequestError", **extra: JsonValue
) -> JSONResponse:
    return JSONResponse({**render.error_body(message, status, kind), **extra}, status_code=status)


class OpenAIRoutes:
    """Route handlers over one engine (its runner, scheduler and validation)."""

    def __init__(self, server: EngineCore) -> None:
        self.server = server

    def routes(self) -> list[Route]:
        return [
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
        ]

    # ---- /v1/models --------------------------------------------------------------------------------------

    async def models(self, request: Request) -> Response:
        server = self.server
        card = {
            "id": server.model_path,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "sglang",
            "root": server.model_path,
            "parent": None,
            "max_model_len": server.context_length,
        }
        return JSONResponse({"object": "list", "data": [card]})

    # ---- chat and completions -----------------------------------------------------------------------------

    async def _render_chat(self, spec: GenerateBody, template: str | None) -> list[int]:
        """The messages through the model's chat template (or the request's own, when the engine trusts
        them), in Jinja's sandbox under a deadline (`chat_template`), then tokenized off the event loop."""
        tokenizer = self.server.runner.tokenizer
        kwargs = {key: value for key, value in spec.template_kwargs.items() if key != "chat_template"}
        if template is not None:
            def render() -> str:
                return render_request_template(template, spec.messages or [], **kwargs)
        else:
            if not getattr(tokenizer, "chat_template", None):
                raise RequestError(
                    f"the model at {self.server.model_path} has no chat template: send 'input_ids', or use "
                    "/v1/completions"
                )

            def render() -> str:
                try:
                    return str(tokenizer.apply_chat_template(spec.messages, tokenize=False, **kwargs))
                except Exception as exc:  # jinja2 errors, and a template's own raise_exception(): bad messages
                    raise RequestError(f"the chat template cannot render these messages: {exc}") from None
        try:
            text = await bounded(render)
        except TemplateRefused as exc:
            raise RequestError(str(exc)) from None
        return await anyio.to_thread.run_sync(lambda: list(tokenizer.encode(text, add_special_tokens=False)))

    def _chat_input(self, body: JsonObject) -> str | None:
        """The request's own chat template (None: the model's) once its messages passed their size limit (413)
        and a template of its own is allowed (400 unless --trust-request-chat-template)."""
        reason = oversized_message(body.get("messages"), self.server.args.max_message_bytes)
        if reason is not None:
            raise RequestTooLarge(f"{reason} (the engine's --max-message-bytes)")
        template = request_template(body)
        if template is None:
            return None
        if not self.server.args.trust_request_chat_template:
            raise RequestError("this engine renders chats with the model's chat template: a request's own "
                               "'chat_template' is refused (the engine's --trust-request-chat-template allows it)")
        if not isinstance(template, str):
            raise RequestError("'chat_template' must be a string")
        return template

    async def _start(self, request: Request, chat: bool) -> tuple[GenerateBody, list[Seq], RequestGroup]:
        body = await read_json(request, self.server.args.max_request_bytes)
        return await self.start(body, chat)

    async def start(self, body: JsonObject, chat: bool = True) -> tuple[GenerateBody, list[Seq], RequestGroup]:
        """An OpenAI body validated, rendered, built and submitted (the other wire formats map onto a chat body
        and come in here)."""
        default_model = self.server.model_path
        template = self._chat_input(body) if chat else None
        vlm = self.server.runner.vision_processor is not None
        spec = chat_request(body, default_model, images=vlm) if chat else completion_request(body, default_model)
        if spec.messages is not None:
            spec.body["input_ids"] = await self._render_chat(spec, template)
        if spec.image_urls:  # the rendered prompt holds one placeholder an image: /generate expands them
            spec.body["image_data"] = list(spec.image_urls)
        seqs, _single, group = await self.server.build(spec.body, expand_images=bool(spec.image_urls))
        await self.server.scheduler.submit(group)
        return spec, seqs, group

    async def chat(self, request: Request) -> Response:
        return await self._serve(request, chat=True)

    async def completions(self, request: Request) -> Response:
        return await self._serve(request, chat=False)

    async def _serve(self, request: Request, *, chat: bool) -> Response:
        try:
            spec, seqs, group = await self._start(request, chat)
        except RequestTooLarge as exc:
            return openai_error(str(exc), 413, "RequestTooLarge")
        except RequestError as exc:
            return openai_error(str(exc))
        except MemoryReleasedError as exc:
            return openai_error(str(exc), 503, "MemoryReleased", released=exc.released)
        n = seqs[0].params.n
        echo = self._echo_texts(spec, seqs) if spec.echo else None
        if spec.stream:
            events = (
                self._chat_events(spec, group, seqs)
                if chat
                else self._completion_events(spec, group, seqs, echo)
            )
            return StreamingResponse(self._sse(events, group, spec, seqs), media_type="text/event-stream")
        await self.server.wait_or_disconnect(request, group)
        items = [self.server.render(seq, with_text=True, final=True) for seq in seqs]
        if chat:
            body = render.chat_response(
                items, model=spec.model, n=n, logprobs=spec.logprobs, meta_info=spec.return_meta_info
            )
        else:
            body = render.completion_response(
                items, model=spec.model, n=n, logprobs=spec.logprobs, echo_texts=echo
            )
        return JSONResponse(body)

    def _echo_texts(self, spec: GenerateBody, seqs: list[Seq]) -> list[str]:
        text = spec.body.get("text")
        if text is not None:
            return [text] if isinstance(text, str) else list(text)
        per_prompt = seqs[:: seqs[0].params.n]
        return [self.server.runner.tokenizer.decode(seq.prompt_ids) for seq in per_prompt]

    # ---- streams -----------------------------------------------------------------------------------------

    async def _sse(
        self, events: AsyncIterator[JsonObject], group: RequestGroup, spec: GenerateBody, seqs: list[Seq]
    ) -> AsyncIterator[str]:
        try:
            async for event in events:
                yield f"data: {json.dumps(event)}\n\n"
            if spec.include_usage:
                items = [
                    {
                        "meta_info": {
                            "prompt_tokens": len(s.prompt_ids),
                            "completion_tokens": len(s.output_ids),
                        }
                    }
                    for s in seqs
                ]
                kind = "chat.completion.chunk" if spec.chat else "text_completion"
                usage_chunk = render.chunk(kind, seqs[0].public_id, spec.model, [], int(time.time()))
                usage_chunk["usage"] = render.usage(items, seqs[0].params.n)
                yield f"data: {json.dumps(usage_chunk)}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            # Reached with sequences still running only when the client went away mid-stream.
            self.server.scheduler.abort_group(group, "client disconnected")

    def _progress(self, seq: Seq, sent: dict[int, tuple[str, int]]) -> tuple[str, int, int] | None:
        """(new text, first new token, end token) since the last event of `seq`, or None when nothing moved."""
        text_sent, tokens_sent = sent.get(seq.index, ("", 0))
        end = len(seq.output_ids)
        if seq.finished:
            text = self.server.scheduler.text_of(seq)
        else:
            tokenizer = self.server.runner.tokenizer
            text = tokenizer.decode(seq.output_ids, skip_special_tokens=seq.params.skip_special_tokens)
            text = text.rstrip("\ufffd")  # hold back a character whose bytes are not all there yet
        if end == tokens_sent and not seq.finished:
            return None
        delta = text[len(text_sent) :] if text.startswith(text_sent) else ""
        sent[seq.index] = (text_sent + delta, end)
        return delta, tokens_sent, end

    def _token_meta(self, seq: Seq, start: int, end: int, top: bool) -> JsonObject:
        decode = self.server.runner.tokenizer.decode
        meta: dict[str, Any] = {
            "output_token_logprobs": [
                [seq.output_logprobs[i], seq.output_ids[i], decode([seq.output_ids[i]])]
                for i in range(start, end)
            ]
        }
        if top:
            meta["output_top_logprobs"] = [
                [[lp, t, decode([t])] for lp, t in seq.output_top_logprobs[i]] for i in range(start, end)
            ]
        return meta

    async def _changes(self, group: RequestGroup, seqs: list[Seq]) -> AsyncIterator[Seq]:
        """Each sequence whenever the scheduler may have advanced it, until the whole group is finished."""
        done: set[int] = set()
        while True:
            group.changed = anyio.Event()
            for seq in seqs:
                if seq.index not in done:
                    if seq.finished:
                        done.add(seq.index)
                    yield seq
            if len(done) == len(seqs):
                return
            await group.changed.wait()

    async def _chat_events(
        self, spec: GenerateBody, group: RequestGroup, seqs: list[Seq]
    ) -> AsyncIterator[JsonObject]:
        created, chunk_id = int(time.time()), seqs[0].public_id
        sent: dict[int, tuple[str, int]] = {}
        started: set[int] = set()

        def event(choice: JsonObject) -> JsonObject:
            return render.chunk("chat.completion.chunk", chunk_id, spec.model, [choice], created)

        async for seq in self._changes(group, seqs):
            if seq.index not in started:
                started.add(seq.index)
                yield event(
                    {
                        "index": seq.index,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                )
            progress = self._progress(seq, sent)
            if progress is None:
                continue
            delta, start, end = progress
            if delta or end > start:
                logprobs = None
                if spec.logprobs:
                    logprobs = render.chat_logprobs(self._token_meta(seq, start, end, spec.top_logprobs > 0))
                yield event(
                    {
                        "index": seq.index,
                        "delta": {"content": delta},
                        "logprobs": logprobs,
                        "finish_reason": None,
                    }
                )
            if seq.finished:
                reason = seq.finish_reason or {}
                yield event(
                    {
                        "index": seq.index,
                        "delta": {},
                        "logprobs": None,
                        "finish_reason": reason.get("type"),
                        "matched_stop": reason.get("matched"),
                    }
                )

    async def _completion_events(
        self, spec: GenerateBody, group: RequestGroup, seqs: list[Seq], echo: list[str] | None
    ) -> AsyncIterator[JsonObject]:
        created, chunk_id = int(time.time()), seqs[0].public_id
        sent: dict[int, tuple[str, int]] = {}
        echoed: set[int] = set()
        n = seqs[0].params.n
        async for seq in self._changes(group, seqs):
            progress = self._progress(seq, sent)
            if progress is None:
                continue
            delta, start, end = progress
            if echo is not None and seq.index not in echoed:
                echoed.add(seq.index)
                delta = echo[seq.index // n] + delta
            logprobs = None
            if spec.logprobs:
                logprobs = render.completion_logprobs(
                    self._token_meta(seq, start, end, spec.top_logprobs > 0), echo=False
                )
            reason = (seq.finish_reason or {}) if seq.finished else {}
            choice = {
                "index": seq.index,
                "text": delta,
                "logprobs": logprobs,
                "finish_reason": reason.get("type"),
                "matched_stop": reason.get("matched"),
            }
            yield render.chunk("text_completion", chunk_id, spec.model, [choice], created)
