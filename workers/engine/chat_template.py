"""Rendering chat templates under a deadline and an output bound: the model's, and a request's own when the
engine trusts them (`--trust-request-chat-template`, vLLM's flag; refused otherwise).

Owns `render_chat` (the engine's one way to render a chat: off the event loop, in Jinja's sandbox, stopped at
`deadline_s` and refused past `max_chars`), `TemplateRefused` and the environment a request's template is
compiled in (`RequestTemplateEnvironment`).

The model's template is rendered by transformers' `apply_chat_template` (its `ImmutableSandboxedEnvironment`).
A request's template is compiled and rendered here, in a sandbox that also intercepts `*` and `**` (Jinja folds
constant expressions while compiling, so `'x' * 10**10` would allocate 10 GB before any deadline could act) and
bounds `range` as Jinja's sandbox does (`MAX_RANGE`); its globals are transformers' (`raise_exception`,
`strftime_now`, `tojson`, `namespace`).

The deadline: a template is Python code once compiled, so the rendering thread is stopped by an exception raised
in it (`PyThreadState_SetAsyncExc`) when the deadline passes — nested loops of 1e10 iterations end at the
deadline, and the event loop (`/health`) never waited on them. Invariant: that exception is raised only while
the render runs (a lock orders the watchdog's firing against the render's end, which clears one not yet
delivered), so it never reaches the thread pool's own code.
"""

from __future__ import annotations

import ctypes
import json
import threading
from collections.abc import Callable
from datetime import datetime
from typing import Any, TypeVar

import anyio
from jinja2 import TemplateError
from jinja2.ext import loopcontrols
from jinja2.runtime import Context
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

from workers.boundary.json_input import JsonObject

T = TypeVar("T")

DEADLINE_S = 2.0  # a real template renders a long chat in milliseconds
MAX_OUTPUT_CHARS = 32 << 20
MAX_REPEAT = 1 << 20  # the largest string or list `*` may build in a request's template


class TemplateRefused(Exception):
    """The chat cannot be rendered: the template raised, took longer than its deadline, or wrote too much."""


class _Deadline(BaseException):
    """Raised inside the rendering thread at its deadline (a BaseException: a template's own `except` cannot
    swallow it)."""


def _raise_in(thread_id: int, exc: type[BaseException] | None) -> None:
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id),
                                               ctypes.py_object(exc) if exc is not None else None)


class _Watch:
    """One render's thread and whether the watchdog stopped it."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.thread_id: int | None = None
        self.done = False
        self.fired = False

    def run(self, render: Callable[[], T]) -> T:
        try:
            with self.lock:
                self.thread_id = threading.get_ident()
            try:
                return render()
            finally:
                with self.lock:
                    self.done = True
                    if self.fired:  # fired but not delivered yet: cleared here, in the render's own frame
                        _raise_in(threading.get_ident(), None)
        except _Deadline:
            raise TemplateRefused("the chat template did not finish within its deadline") from None

    def fire(self) -> None:
        with self.lock:
            if self.thread_id is not None and not self.done and not self.fired:
                self.fired = True
                _raise_in(self.thread_id, _Deadline)


async def bounded(render: Callable[[], str], *, deadline_s: float = DEADLINE_S,
                  max_chars: int = MAX_OUTPUT_CHARS) -> str:
    """`render()` in a worker thread, stopped at `deadline_s`; its text refused past `max_chars`."""
    watch = _Watch()
    # A timer thread, not a task: the wait on the worker thread is shielded from cancellation, and a
    # cancelled request must still stop its render at the deadline.
    timer = threading.Timer(deadline_s, watch.fire)
    timer.daemon = True
    timer.start()
    try:
        text = await anyio.to_thread.run_sync(watch.run, render)
    finally:
        timer.cancel()
    if len(text) > max_chars:
        raise TemplateRefused(f"the chat template wrote {len(text)} characters, over {max_chars}")
    return text


# ---- a request's own template -------------------------------------------------------------------------------

def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _tojson(value: object, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None,
            sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class RequestTemplateEnvironment(ImmutableSandboxedEnvironment):
    """transformers' chat-template sandbox, with `*` and `**` bounded so nothing large is built (at compile
    time or render time) from a few characters of template."""

    intercepted_binops = frozenset({"*", "**"})

    def __init__(self) -> None:
        super().__init__(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        self.filters["tojson"] = _tojson
        self.globals["raise_exception"] = _raise_exception
        self.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)

    def call_binop(self, context: Context, operator: str, left: Any, right: Any) -> object:
        if operator == "**":
            if (isinstance(right, int) and abs(right) > 64) or (isinstance(left, int) and abs(left) > 1 << 64):
                raise SecurityError("a power this large is not computed in a chat template")
            return left**right
        for seq, times in ((left, right), (right, left)):
            if isinstance(seq, (str, list, tuple)) and isinstance(times, int) and len(seq) * times > MAX_REPEAT:
                raise SecurityError(f"a repetition of more than {MAX_REPEAT} items in a chat template")
        return left * right


def render_request_template(template: str, messages: list[JsonObject], *, add_generation_prompt: bool,
                            tools: object = None, **kwargs: object) -> str:
    """A request's own template over `messages`, as transformers passes its variables (blocking)."""
    try:
        compiled = RequestTemplateEnvironment().from_string(template)
        return compiled.render(messages=messages, tools=tools, documents=None,
                               add_generation_prompt=add_generation_prompt, **kwargs)
    except (TemplateError, OverflowError, TypeError, ValueError, RecursionError) as error:
        raise TemplateRefused(f"the request's chat template failed: {error}") from None
