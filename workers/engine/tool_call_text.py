"""Tool calls in a model's text, Qwen/Hermes style (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`),
as SGLang's `qwen25` / `hermes` function-call detectors read them, for the engine's `/v1/messages` and
`/v1/responses` (which return tool calls as structured blocks where `/v1/chat/completions` leaves them in the
text).

Owns `split_tool_calls` (a finished text → the text before the first call and the calls) and `held_back` /
`sendable` (how much of a streamed text may be sent before a possible `<tool_call>` opening or stop string).

Invariants: a block whose JSON does not parse (bounded: model output is untrusted), or that names a tool the
request did not offer, is not a call (SGLang skips unknown tools); when no call is found the whole text stays
text, so no output is lost; arguments are always a JSON object.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from workers.boundary.json_input import JsonLimits, decode_json

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_LIMITS = JsonLimits(max_bytes=1 << 20, max_depth=32, max_items=100_000)
SOURCE = "tool call in the model's output"


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: dict[str, Any]


def _call(block: str, known: set[str]) -> ParsedCall | None:
    try:
        data = decode_json(block, SOURCE, _LIMITS)
    except ValueError:
        return None
    if not isinstance(data, dict) or data.get("name") not in known:
        return None
    arguments = data.get("arguments", data.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = decode_json(arguments, SOURCE, _LIMITS)
        except ValueError:
            return None
    return ParsedCall(str(data["name"]), arguments) if isinstance(arguments, dict) else None


def split_tool_calls(text: str, known: set[str]) -> tuple[str, list[ParsedCall]]:
    """(the text before the first `<tool_call>`, the calls) — or (text, []) when nothing in it is a call."""
    if not known or OPEN not in text:
        return text, []
    calls = [call for block in _BLOCK.findall(text) if (call := _call(block, known)) is not None]
    if not calls:
        return text, []
    return text[: text.index(OPEN)], calls


def held_back(text: str, markers: list[str]) -> int:
    """Where a stream must stop sending `text` for now: at the first of `markers` in it (a `<tool_call>` opening,
    a stop string the engine will trim), or at a tail that may become one (`<tool`), so that neither call markup
    nor a stop string that is cut at the end ever reaches the client as text."""
    cut = len(text)
    for marker in markers:
        start = text.find(marker)
        if start != -1:
            cut = min(cut, start)
            continue
        for size in range(min(len(marker) - 1, len(text)), 0, -1):
            if text.endswith(marker[:size]):
                cut = min(cut, len(text) - size)
                break
    return cut


def assistant_turn(prefill: str, generated: str, known: set[str]) -> tuple[str, list[ParsedCall]]:
    """The text to return and the calls of a turn that continued `prefill` (an assistant message the request
    ended with; "" when none) with `generated`: calls are read from the whole turn, so a call the prefill opened
    and the model closed is found; the text returned is only what the model wrote (the prefill is the client's)."""
    if not calls_possible(known, prefill + generated):
        return generated, []
    normal, calls = split_tool_calls(prefill + generated, known)
    if not calls:
        return generated, []
    return normal[len(prefill) :], calls


def calls_possible(known: set[str], text: str) -> bool:
    return bool(known) and OPEN in text


def sendable(prefill: str, generated: str, known: set[str], stops: list[str] | None = None) -> int:
    """How many characters of `generated` a stream may send now: all of them unless tools were offered (call
    markup, read from the prefill on) or stop strings asked (matched in the generated text, trimmed at the end)."""
    cut = len(generated)
    if known:
        cut = min(cut, max(held_back(prefill + generated, [OPEN]) - len(prefill), 0))
    stops = [stop for stop in stops or [] if stop]
    if stops:
        cut = min(cut, held_back(generated, stops))
    return cut
