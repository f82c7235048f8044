"""`BoundaryError`: input refused at the boundary, naming where it came from (a peer, a file and line)."""

from __future__ import annotations


class BoundaryError(ValueError):
    """Refused input. `source` names the peer (``engine 127.0.0.1:30000``) or file (``prompts.jsonl:618``)."""

    def __init__(self, source: str, reason: str) -> None:
        super().__init__(f"{source}: {reason}")
        self.source = source
        self.reason = reason
