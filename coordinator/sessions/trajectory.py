"""One agent session: its linear trajectory of chat turns, and the training sample built from it (miles' v1).

Owns `Session` (the stored messages and token ids after each turn, the records of every call) and
`assemble` (the turns → the fields of one `Sample`).

Invariants:
- each turn's prompt ids start with the previous turn's prompt and output ids (append-only), so the last
  turn's ids hold every turn; a request that continues an earlier turn (an agent's retry) drops the turns
  after it, and one that continues none starts the trajectory again;
- the sample's response is everything after the first prompt: loss mask 1 and the engine's logprob on each
  token the engine generated, 0 and 0.0 on everything between turns (tool output, templates);
- the first turn not finished by `stop` ends the trajectory (its status is the sample's); `max_seq_len`
  cuts at that many tokens, the turn it falls in truncated and later ones dropped.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import Any

import anyio

from coordinator.sessions.tito import Matcher, SessionRequestError, TitoTokenizer
from replay.sample import FINISH_STATUS, SampleStatus


@dataclass
class Turn:
    prompt_ids: list[int]
    output_ids: list[int]
    logprobs: list[float]
    finish: str | None
    weight_version: str | None
    #: the messages this turn's request sent plus the assistant message it got back
    messages: list[dict[str, Any]]


@dataclass
class Session:
    id: str = field(default_factory=lambda: secrets.token_hex(16))
    engine: Any = None
    turns: list[Turn] = field(default_factory=list)
    records: list[dict[str, Any]] = field(default_factory=list)
    lock: anyio.Lock = field(default_factory=anyio.Lock)
    closed: bool = False

    def prompt_ids(self, messages: list[dict[str, Any]], tools: list[Any] | None, tito: TitoTokenizer,
                   matches: Matcher) -> tuple[list[int], int]:
        """The prompt ids of a request with these messages, and how many stored turns it continues (the later
        ones are dropped when the turn is recorded)."""
        for kept in range(len(self.turns), 0, -1):
            stored = self.turns[kept - 1].messages
            if len(messages) > len(stored) and all(matches(a, b) for a, b in zip(stored, messages, strict=False)):
                turn = self.turns[kept - 1]
                appended = tito.appended_ids(stored[-1], messages[len(stored):], tools)
                return tito.merge(turn.prompt_ids + turn.output_ids, appended), kept
        if self.turns:
            asked = self.turns[0].messages[:-1]  # the first turn's request: sending it again is a retry
            same = len(asked) == len(messages) and all(matches(a, b) for a, b in zip(asked, messages, strict=True))
            if not same:
                stored = self.turns[-1].messages
                first = next((i for i, (a, b) in enumerate(zip(stored, messages, strict=False))
                              if not matches(a, b)), min(len(stored), len(messages)))
                raise SessionRequestError(
                    f"the request's messages do not continue the session (first difference at message {first}): "
                    "a session's requests append to its own turns (the stored messages, the assistant's reply, "
                    "then new messages)")
        return tito.first_prompt(messages, tools), 0

    def record(self, turn: Turn, kept: int, record: dict[str, Any]) -> None:
        del self.turns[kept:]
        self.turns.append(turn)
        self.records.append(record)


@dataclass
class Assembled:
    """The trajectory as a sample's fields (`Sample.tokens`, ... ); `turns` counts the turns it holds."""

    tokens: list[int]
    response_length: int
    loss_mask: list[int]
    rollout_log_probs: list[float]
    status: SampleStatus
    weight_versions: list[str]
    turns: int


def _trajectory(turns: list[Turn]) -> list[Turn]:
    kept = []
    for turn in turns:
        kept.append(turn)
        if turn.finish != "stop":
            break
    return kept


def assemble(turns: list[Turn], *, max_seq_len: int | None = None) -> Assembled | None:
    """The sample of a session's turns; None when there is none (no turn, or the prompt alone is too long)."""
    turns = _trajectory(turns)
    if not turns or (max_seq_len is not None and len(turns[0].prompt_ids) >= max_seq_len):
        return None
    last = turns[-1]
    tokens = last.prompt_ids + last.output_ids
    start = len(turns[0].prompt_ids)
    mask = [0] * (len(tokens) - start)
    logprobs = [0.0] * (len(tokens) - start)
    for index, turn in enumerate(turns):
        begin = len(turn.prompt_ids)
        if tokens[:begin] != turn.prompt_ids or tokens[begin:begin + len(turn.output_ids)] != turn.output_ids:
            raise ValueError(f"turn {index} of the session is not a prefix of its last turn")
        for offset, logprob in enumerate(turn.logprobs):
            mask[begin - start + offset] = 1
            logprobs[begin - start + offset] = float(logprob)
    status = FINISH_STATUS.get(last.finish or "abort", SampleStatus.ABORTED)
    if max_seq_len is not None and len(tokens) > max_seq_len:
        tokens, cut = tokens[:max_seq_len], max_seq_len - start
        mask, logprobs = mask[:cut], logprobs[:cut]
        turns = [t for t in turns if len(t.prompt_ids) < max_seq_len]
        status = SampleStatus.TRUNCATED
    return Assembled(tokens=tokens, response_length=len(tokens) - start, loss_mask=mask, rollout_log_probs=logprobs,
                     status=status, weight_versions=[t.weight_version or "" for t in turns], turns=len(turns))
