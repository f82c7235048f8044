"""The records of generation: one sequence's state (`Seq`), the sequences of one request (`RequestGroup`),
and the refusal of a released engine (`MemoryReleasedError`).

Owns the data only; the scheduler changes it, on the event loop. Invariant: a sequence's state only moves
forward (waiting, running, finished), except that a retracting pause puts a running one back to waiting.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import anyio
import torch

from workers.engine.sampling import SamplingParams
from workers.vlm_processor import PixelInputs


class MemoryReleasedError(Exception):
    """A request to an engine whose memory is released (the server answers 503, type MemoryReleased)."""

    def __init__(self, released: set[str]) -> None:
        self.released = sorted(released)
        super().__init__(
            f"the engine's memory is released ({', '.join(self.released)}); "
            "it generates again after /resume_memory_occupation"
        )


class SeqState(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Seq:
    """One generated sample (a prompt with n = 3 makes three)."""

    public_id: str  # meta_info.id
    rid: str | None  # the rid the client sent, for /abort_request
    prompt_ids: list[int]
    params: SamplingParams
    generator: torch.Generator
    group: RequestGroup
    index: int
    return_logprob: bool = False
    logprob_start: int = 0  # resolved: first prompt position whose logprob is returned
    top_logprobs_num: int = 0
    token_ids_logprob: tuple[int, ...] = ()  # SGLang's: ids whose logprob each position reports
    position_token_ids: tuple[tuple[int, ...], ...] | None = None  # miles' per-position ids (input only)
    vision: PixelInputs | None = None  # a VLM prompt's images (prompt_ids hold their expanded placeholders)
    bypass_pause: bool = False
    key: str = field(default_factory=lambda: uuid.uuid4().hex)  # unique row key inside the runner
    state: SeqState = SeqState.WAITING
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    input_logprobs: list[tuple[float | None, int]] | None = None
    input_top_logprobs: list[list[tuple[float, int]]] | None = None
    output_token_ids_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    input_token_ids_logprobs: list[list[tuple[float, int]]] | None = None
    finish_reason: dict[str, Any] | None = None
    max_new_tokens: int = -1  # resolved (a null max_new_tokens is what the context leaves); -1: params'
    weight_version: str = "default"
    latency: float | None = None

    def __post_init__(self) -> None:
        if self.max_new_tokens < 0:
            self.max_new_tokens = self.params.max_new_tokens or 0

    @property
    def finished(self) -> bool:
        return self.state is SeqState.FINISHED


@dataclass(eq=False)
class RequestGroup:
    """The sequences of one /generate call; `changed` is set when any of them advances (stream) or ends."""

    seqs: list[Seq] = field(default_factory=list)
    stream: bool = False
    created: float = field(default_factory=time.perf_counter)
    changed: anyio.Event = field(default_factory=anyio.Event)

    @property
    def finished(self) -> bool:
        return all(seq.finished for seq in self.seqs)

    async def wait_finished(self) -> None:
        while True:
            self.changed = anyio.Event()
            if self.finished:
                return
            await self.changed.wait()
