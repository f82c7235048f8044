"""One agent session: its linear trajectory of chat turns, and the training sample built from it (miles' v1).

Owns `Session` (the trajectory's token ids and messages, and per turn where its prompt ends, what the engine
generated, and the call's record) and `assemble` (the turns → the fields of one `Sample`).

Invariants:
- each turn's prompt ids start with the previous turn's prompt and output ids (append-only), so one list,
  `Session.token_ids`, holds every turn, and one list, `Session.messages`, every message: a session's memory
  grows with its tokens and messages, not with turns × tokens (records keep neither the prompt ids nor the
  messages; `describe` rebuilds them from the two lists);
- a request that continues an earlier turn (an agent's retry) drops the turns after it; sending the first
  request again starts the trajectory again; anything else is a `SessionRequestError`;
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
from workers.boundary.json_input import JsonObject, JsonValue


@dataclass
class Turn:
    prompt_len: int
    output_ids: list[int]
    logprobs: list[float]
    finish: str | None
    weight_version: str | None
    #: how many of the session's messages its request sent, and how many there are after its reply
    asked: int
    answered: int
    #: the call's request (without `messages` and `input_ids`) and the engine's response
    record: dict[str, Any] = field(default_factory=dict)

    @property
    def end(self) -> int:
        return self.prompt_len + len(self.output_ids)


@dataclass
class Session:
    id: str = field(default_factory=lambda: secrets.token_hex(16))
    engine: Any = None
    turns: list[Turn] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    messages: list[dict[str, Any]] = field(default_factory=list)
    lock: anyio.Lock = field(default_factory=anyio.Lock)
    closed: bool = False

    def _continues(self, turn: Turn, messages: list[JsonObject], matches: Matcher) -> bool:
        stored = self.messages[:turn.answered]
        return len(messages) > len(stored) and all(matches(a, b) for a, b in zip(stored, messages, strict=False))

    def prompt_ids(self, messages: list[JsonObject], tools: list[JsonValue] | None, tito: TitoTokenizer,
                   matches: Matcher) -> tuple[list[int], int]:
        """The prompt ids of a request with these messages, and how many stored turns it continues (the later
        ones are dropped when the turn is recorded)."""
        for kept in range(len(self.turns), 0, -1):
            turn = self.turns[kept - 1]
            if self._continues(turn, messages, matches):
                appended = tito.appended_ids(self.messages[turn.answered - 1], messages[turn.answered:], tools)
                return tito.merge(self.token_ids[:turn.end], appended), kept
        if self.turns:
            asked = self.messages[:self.turns[0].asked]  # the first turn's request: sending it again is a retry
            same = len(asked) == len(messages) and all(matches(a, b) for a, b in zip(asked, messages, strict=True))
            if not same:
                stored = self.messages
                first = next((i for i, (a, b) in enumerate(zip(stored, messages, strict=False))
                              if not matches(a, b)), min(len(stored), len(messages)))
                raise SessionRequestError(
                    f"the request's messages do not continue the session (first difference at message {first}): "
                    "a session's requests append to its own turns (the stored messages, the assistant's reply, "
                    "then new messages)")
        return tito.first_prompt(messages, tools), 0

    def record(self, *, kept: int, prompt_ids: list[int], messages: list[JsonObject], reply: JsonObject,
               output_ids: list[int], logprobs: list[float], finish: str | None, weight_version: str | None,
               record: JsonObject) -> Turn:
        """Append a turn after the first `kept` ones (dropping the rest): `messages` are its request's."""
        del self.turns[kept:]
        turn = Turn(prompt_len=len(prompt_ids), output_ids=output_ids, logprobs=logprobs, finish=finish,
                    weight_version=weight_version, asked=len(messages), answered=len(messages) + 1, record=record)
        self.token_ids = prompt_ids + output_ids
        self.messages = [*messages, reply]
        self.turns.append(turn)
        return turn

    def describe(self) -> list[JsonObject]:
        """The records of the turns, each request with its `messages` and `input_ids` again."""
        records = []
        for turn in self.turns:
            request = {**turn.record.get("request", {}), "messages": self.messages[:turn.asked],
                       "input_ids": self.token_ids[:turn.prompt_len]}
            records.append({**turn.record, "request": request})
        return records


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


def assemble(session: Session, *, max_seq_len: int | None = None) -> Assembled | None:
    """The sample of a session's turns; None when there is none (no turn, or the prompt alone is too long)."""
    turns = _trajectory(session.turns)
    if not turns or (max_seq_len is not None and turns[0].prompt_len >= max_seq_len):
        return None
    tokens = session.token_ids[:turns[-1].end]
    start = turns[0].prompt_len
    mask = [0] * (len(tokens) - start)
    logprobs = [0.0] * (len(tokens) - start)
    for index, turn in enumerate(turns):
        if tokens[turn.prompt_len:turn.end] != turn.output_ids:
            raise ValueError(f"turn {index} of the session is not a prefix of its last turn")
        for offset, logprob in enumerate(turn.logprobs):
            mask[turn.prompt_len - start + offset] = 1
            logprobs[turn.prompt_len - start + offset] = float(logprob)
    status = FINISH_STATUS.get(turns[-1].finish or "abort", SampleStatus.ABORTED)
    if max_seq_len is not None and len(tokens) > max_seq_len:
        tokens, cut = tokens[:max_seq_len], max_seq_len - start
        mask, logprobs = mask[:cut], logprobs[:cut]
        turns = [t for t in turns if t.prompt_len < max_seq_len]
        status = SampleStatus.TRUNCATED
    return Assembled(tokens=tokens, response_length=len(tokens) - start, loss_mask=mask, rollout_log_probs=logprobs,
                     status=status, weight_versions=[t.weight_version or "" for t in turns], turns=len(turns))
