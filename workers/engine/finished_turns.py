"""A finished assistant turn as the structured wire formats answer it (`/v1/messages`, `/v1/responses`), with
no engine state: the engine's turn runner builds one from a sequence, the session server from an engine's chat
reply (`coordinator.sessions.wire_formats`), and both answer with the same reply shapes (`anthropic_replies`,
`responses_replies`).

Owns `Turn`. Invariant: importing it imports no torch (the coordinator's session server uses it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from workers.engine.tool_call_text import ParsedCall


@dataclass
class Turn:
    """A finished turn: `text` is what the model wrote after any prefill, without call markup when calls were
    found; `finish` the engine's finish type (`stop`, `length`, `abort`), `matched` its matched stop."""

    id: str
    text: str
    calls: list[ParsedCall]
    finish: str | None
    matched: Any
    prompt_tokens: int
    output_tokens: int
    meta_info: dict[str, Any] | None
