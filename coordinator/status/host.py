"""Facts the status document takes from this machine rather than from the run's objects: the last line of
each engine's log and the ranks' resident memory.

Owns `host_facts`, run in a worker thread (it reads files and /proc). Invariant: bounded work — at most
`TAIL_BYTES` read from the end of each log, one /proc read per local rank; a file or process that is gone
gives no entry, never an error.
"""

from __future__ import annotations

from pathlib import Path

from workers.boundary.json_input import JsonObject

TAIL_BYTES = 4096


def last_line(path: Path, tail_bytes: int = TAIL_BYTES) -> str:
    """The last non-empty line of `path` (read from its last `tail_bytes`), "" when none or unreadable."""
    try:
        with path.open("rb") as file:
            file.seek(0, 2)
            size = file.tell()
            file.seek(max(0, size - tail_bytes))
            tail = file.read(tail_bytes)
    except OSError:
        return ""
    lines = [line for line in tail.decode("utf-8", "replace").splitlines() if line.strip()]
    return lines[-1].strip()[:300] if lines else ""


def rss_bytes(pid: int) -> int | None:
    import psutil

    try:
        return int(psutil.Process(pid).memory_info().rss)
    except (psutil.Error, OSError):
        return None


def host_facts(logs: dict[str, Path], rank_pids: dict[int, int]) -> JsonObject:
    """`{"log_lines": {engine: line}, "rank_memory": {rank: bytes}}`; `rank_pids` only of this node's ranks."""
    memory = {rank: rss for rank, pid in rank_pids.items() if (rss := rss_bytes(pid)) is not None}
    return {"log_lines": {name: last_line(path) for name, path in logs.items()}, "rank_memory": memory}
