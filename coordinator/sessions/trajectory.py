"""A session's turns as a tree of messages, and its samples: one per leaf (slime's `TrajectoryManager` design).

Owns `Session` (the message tree, the recorded `Turn`s, the session's bounds), `Mount` (where a request's turn
goes in the tree and what its prompt ids extend), and `assemble` (the tree → the fields of its `Sample`s).

How a request is routed: its messages are walked down the tree from the root, each matched against a child by the
session's message matcher (`--session-message-matcher`); the deepest generated assistant turn on the matched
path is the *anchor*. When everything after the anchor is new messages of an appendable role (user, tool, system,
developer; a TITO family that narrows them refuses the others with miles' error), the prompt is the anchor's exact ids followed by the ids the template adds for those messages (token
in, token out: nothing generated is re-tokenised). Otherwise — a sub-agent with its own conversation, a compacted
history, a client that rewrote or replayed an assistant message, a retry — the prompt is the chat template over
all its messages, and the turn hangs in a new branch. Unmatched messages are mounted below the match as routing
nodes and the reply as a generated assistant leaf. A rewritten assistant message that replaces a short generated
leaf (fewer than `fork_threshold` output tokens) takes that leaf's place and the abandoned answer is not trained
(slime's rewrite merge); a longer one forks and trains on its own.

How a tree becomes samples (`assemble`): for each leaf, in the order the branches were made, the generated turns
on its path (up to and including the first one not finished by `stop`) are laid end to end. A turn whose prompt
extends the tokens held so far continues the sample (CLEAN); one whose prompt differs only inside the previous
answer, with a short answer of its own, replaces that span as context (REALIGN: loss mask 0); anything else
starts a new sample (FORK). A turn shared by several leaves trains in the first sample that holds it and is
context (mask 0, logprob 0.0) in the others; a sample with nothing left to train is dropped. So each generated
token is trained exactly once.

Invariants:
- memory grows with the session's tokens and messages, not turns × tokens: each turn keeps only the prompt ids
  after the turn it extends and its own output; each message is one node;
- a sample's loss mask is 1 exactly on tokens the engine generated (with its logprob), 0 and 0.0 elsewhere; its
  response is everything after its first prompt; `max_seq_len` cuts it (status TRUNCATED) and drops a sample
  whose first prompt alone fills it;
- a session holds at most `SessionBounds` turns, tree nodes and stored tokens (a `SessionFull` beyond, answered
  413 by the server, the session kept as it was).
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import anyio

from coordinator.sessions.tito import ALLOWED_APPEND_ROLES, Matcher, SessionRequestError, TitoTokenizer
from replay.sample import FINISH_STATUS, SampleStatus
from workers.boundary.json_input import JsonObject, JsonValue

#: slime's default: a drifted answer this long forks instead of being realigned or merged away
FORK_THRESHOLD_TOKENS = 1024


class SessionFull(SessionRequestError):
    """A turn that would take the session past one of its bounds (answered 413)."""


@dataclass(frozen=True)
class SessionBounds:
    """What one session may hold. The defaults fit a 1,000-turn agent at 32k tokens a turn of new context."""

    max_turns: int = 4096
    max_nodes: int = 65536
    max_tokens: int = 32 * 1024 * 1024
    max_message_bytes_total: int = 256 * 1024 * 1024


@dataclass(eq=False)
class Turn:
    """One generated answer. Its prompt is `parent`'s ids (prompt and output) followed by `appended`; with no
    parent, `appended` is the whole prompt (the template over the request's messages)."""

    index: int
    parent: Turn | None = field(repr=False)
    appended: list[int]
    output_ids: list[int]
    logprobs: list[float]
    finish: str | None
    weight_version: str | None
    node: Node = field(repr=False)
    #: the call's request (without `messages` and `input_ids`) and the engine's response
    record: JsonObject = field(default_factory=dict)
    prompt_len: int = 0

    def __post_init__(self) -> None:
        self.prompt_len = (self.parent.end if self.parent is not None else 0) + len(self.appended)

    @property
    def end(self) -> int:
        return self.prompt_len + len(self.output_ids)

    def prompt_ids(self) -> list[int]:
        chain: list[Turn] = []
        turn: Turn | None = self
        while turn is not None:
            chain.append(turn)
            turn = turn.parent
        ids: list[int] = []
        for step in reversed(chain):
            ids += step.appended
            if step is not self:
                ids += step.output_ids
        return ids

    def ids(self) -> list[int]:
        return self.prompt_ids() + self.output_ids


@dataclass(eq=False)
class Node:
    """A message of the tree (None at the root); `turn` is set on an assistant answer this session generated."""

    message: JsonObject | None = None
    parent: Node | None = field(default=None, repr=False)
    children: list[Node] = field(default_factory=list, repr=False)
    turn: Turn | None = None

    def path(self) -> list[Node]:
        nodes: list[Node] = []
        node: Node | None = self
        while node is not None and node.parent is not None:
            nodes.append(node)
            node = node.parent
        nodes.reverse()
        return nodes

    def leaves(self) -> Iterator[Node]:
        stack: list[Node] = [self]
        while stack:
            node = stack.pop()
            if not node.children:
                yield node
            stack.extend(reversed(node.children))


@dataclass
class Mount:
    """Where a request's turn goes: below `node` (which matched its first `depth` messages), its prompt extending
    `parent` (None: rendered afresh); `demote` a short generated leaf its rewritten assistant message replaces."""

    node: Node
    depth: int
    parent: Turn | None
    demote: Node | None = None


def _message_bytes(message: JsonObject) -> int:
    return len(json.dumps(message, separators=(",", ":"), default=str))


@dataclass
class Session:
    id: str = field(default_factory=lambda: secrets.token_hex(16))
    engine: Any = None
    root: Node = field(default_factory=Node, repr=False)
    turns: list[Turn] = field(default_factory=list, repr=False)
    bounds: SessionBounds = field(default_factory=SessionBounds)
    fork_threshold: int = FORK_THRESHOLD_TOKENS
    lock: anyio.Lock = field(default_factory=anyio.Lock)
    closed: bool = False
    #: when an agent last called it (time.monotonic): a session idle since before a rollout began is reaped at
    #: that rollout's end (`SessionServer.reap`)
    touched: float = field(default_factory=time.monotonic)
    nodes: int = 0
    tokens: int = 0
    message_bytes: int = 0
    #: the last recorded answer's leaf, the messages of its path and its ids: most requests extend it, and
    #: comparing against it at C speed keeps a long session's turns from costing turns x messages in Python
    _tail: tuple[Node, list[JsonObject], list[int]] | None = field(default=None, repr=False)

    @property
    def token_ids(self) -> list[int]:
        """The last recorded turn's ids (prompt and output)."""
        return self.turns[-1].ids() if self.turns else []

    def _walk(self, messages: list[JsonObject], matches: Matcher) -> tuple[Node, int]:
        node, depth = self.root, 0
        if self._tail is not None:
            leaf, path_messages, _ = self._tail
            if len(messages) > len(path_messages) and messages[:len(path_messages)] == path_messages:
                node, depth = leaf, len(path_messages)
        while depth < len(messages):
            message = messages[depth]
            # plain equality first: an agent usually sends its stored messages back unchanged (the matcher's
            # normalisation costs microseconds a message, on every message of every turn)
            child = next((c for c in node.children if c.message is not None and c.message == message), None) \
                or next((c for c in node.children if c.message is not None
                         and c.message.get("role") == message.get("role") and matches(c.message, message)), None)
            if child is None:
                break
            node, depth = child, depth + 1
        return node, depth

    def _rewritten_leaf(self, node: Node, messages: list[JsonObject], depth: int) -> Node | None:
        """The one short generated leaf a rewritten assistant message at `depth` replaces (slime's merge)."""
        if self.fork_threshold <= 0 or depth >= len(messages) or messages[depth].get("role") != "assistant":
            return None
        answers = [c for c in node.children if c.message is not None and c.message.get("role") == "assistant"]
        if len(answers) != 1:
            return None
        leaf = answers[0]
        if leaf.children or leaf.turn is None or len(leaf.turn.output_ids) >= self.fork_threshold:
            return None
        return leaf

    def prompt_ids(self, messages: list[JsonObject], tools: list[JsonValue] | None, tito: TitoTokenizer,
                   matches: Matcher) -> tuple[list[int], Mount]:
        """The prompt ids of a request with these messages, and where its turn will be recorded."""
        if not messages:
            raise SessionRequestError("a request needs at least one message")
        node, depth = self._walk(messages, matches)
        demote = self._rewritten_leaf(node, messages, depth)
        if self._tail is not None and node is self._tail[0]:
            path, stored = None, self._tail[2]
            anchor_at = depth - 1
            anchor = node
        else:
            path, stored = node.path(), None
            anchor_at = max((i for i, n in enumerate(path) if n.turn is not None), default=None)
            anchor = path[anchor_at] if anchor_at is not None else node
        if demote is None and anchor_at is not None:
            after = messages[anchor_at + 1:]
            # a family that narrows the roles (qwen35: user and tool) refuses the others here, as miles does
            if after and all(m.get("role") in ALLOWED_APPEND_ROLES for m in after):
                assert anchor.turn is not None and anchor.message is not None
                appended = tito.appended_ids(anchor.message, after, tools)
                return tito.merge(stored if stored is not None else anchor.turn.ids(), appended), \
                    Mount(node, depth, anchor.turn)
        return tito.first_prompt(messages, tools), Mount(node, depth, None, demote)

    def record(self, *, kept: Mount, prompt_ids: list[int], messages: list[JsonObject], reply: JsonObject,
               output_ids: list[int], logprobs: list[float], finish: str | None, weight_version: str | None,
               record: JsonObject) -> Turn:
        """Record a turn where `kept` (from `prompt_ids`) says: its request's messages and the engine's reply."""
        mount = kept
        start = mount.parent.end if mount.parent is not None else 0
        if len(prompt_ids) < start:
            raise SessionRequestError("the prompt does not extend the turn it continues")
        appended = list(prompt_ids[start:])
        node, rest = mount.node, messages[mount.depth:]
        if mount.demote is not None:  # the rewritten answer takes the short generated leaf's place
            rest = rest[1:]
        new_nodes = len(rest) + 1
        new_bytes = sum(_message_bytes(m) for m in rest) + _message_bytes(reply)
        bounds = self.bounds
        if len(self.turns) >= bounds.max_turns:
            raise SessionFull(f"the session holds its limit of {bounds.max_turns} turns")
        if self.nodes + new_nodes > bounds.max_nodes:
            raise SessionFull(f"the session holds its limit of {bounds.max_nodes} messages in its tree")
        if self.tokens + len(appended) + len(output_ids) > bounds.max_tokens:
            raise SessionFull(f"the session holds its limit of {bounds.max_tokens} stored tokens")
        if self.message_bytes + new_bytes > bounds.max_message_bytes_total:
            raise SessionFull(f"the session holds its limit of {bounds.max_message_bytes_total} bytes of messages")
        if mount.demote is not None:
            mount.demote.turn = None
            mount.demote.message = messages[mount.depth]
            node = mount.demote
        for message in rest:
            child = Node(message=message, parent=node)
            node.children.append(child)
            node = child
        leaf = Node(message=reply, parent=node)
        node.children.append(leaf)
        turn = Turn(index=len(self.turns), parent=mount.parent, appended=appended, output_ids=list(output_ids),
                    logprobs=[float(v) for v in logprobs], finish=finish, weight_version=weight_version, node=leaf,
                    record=record)
        leaf.turn = turn
        if mount.demote is None and self._tail is not None and mount.node is self._tail[0]:
            path_messages = [*self._tail[1], *rest, reply]
        else:
            path_messages = [n.message for n in leaf.path()]  # type: ignore[misc]
        self._tail = (leaf, path_messages, list(prompt_ids) + turn.output_ids)
        self.turns.append(turn)
        self.nodes += new_nodes
        self.tokens += len(appended) + len(output_ids)
        self.message_bytes += new_bytes
        return turn

    def describe(self) -> list[JsonObject]:
        """The records of the turns in the order they were made, each request with its `messages` and `input_ids`
        again (rebuilt from the tree)."""
        records = []
        for turn in self.turns:
            assert turn.node.parent is not None
            asked = [n.message for n in turn.node.parent.path()]
            request = {**turn.record.get("request", {}), "messages": asked, "input_ids": turn.prompt_ids()}
            records.append({**turn.record, "request": request})
        return records

    def leaves(self) -> int:
        return sum(1 for leaf in self.root.leaves() if leaf is not self.root)


@dataclass
class Assembled:
    """One sample's fields (`Sample.tokens`, ...); `turns` counts the turns it holds, `leaf` which leaf of the
    session's tree (in the order the branches were made) it comes from."""

    tokens: list[int]
    response_length: int
    loss_mask: list[int]
    rollout_log_probs: list[float]
    status: SampleStatus
    weight_versions: list[str]
    turns: int
    leaf: int = 0
    #: the data URLs of the image parts of the last turn's request (a VLM session: the images of `tokens`)
    images: list[str] = field(default_factory=list)


def _common_prefix(a: list[int], b: list[int]) -> int:
    limit = min(len(a), len(b))
    index = 0
    while index < limit and a[index] == b[index]:
        index += 1
    return index


class _Builder:
    """One sample's tokens being laid down turn by turn (slime's `_SampleBuilder`)."""

    def __init__(self, turn: Turn) -> None:
        self.tokens = turn.prompt_ids()
        self.mask = [0] * len(self.tokens)
        self.logprobs = [0.0] * len(self.tokens)
        self.lead = len(self.tokens)
        self.last_start: int | None = None
        self.last: Turn | None = None  # the last turn answered: the held tokens are exactly its ids
        self.turns: list[Turn] = []

    def absorbs(self, turn: Turn, fork_threshold: int) -> bool:
        """Lay `turn`'s prompt after the held tokens (CLEAN) or over the last answer (REALIGN); False: FORK."""
        if self.last is not None and turn.parent is self.last:  # token in, token out: exactly extends
            self.mask += [0] * len(turn.appended)
            self.logprobs += [0.0] * len(turn.appended)
            self.tokens += turn.appended
            return True
        prompt = turn.prompt_ids()
        common = _common_prefix(self.tokens, prompt)
        if common == len(self.tokens):
            tail = prompt[common:]
        elif self.last_start is not None and common >= self.last_start and len(turn.output_ids) < fork_threshold:
            tail = prompt[self.last_start:]
            del self.tokens[self.last_start:], self.mask[self.last_start:], self.logprobs[self.last_start:]
        else:
            return False
        self.tokens += tail
        self.mask += [0] * len(tail)
        self.logprobs += [0.0] * len(tail)
        return True

    def answer(self, turn: Turn, trained: bool) -> None:
        # Whichever way the prompt was laid, the held tokens are now exactly the turn's prompt ids.
        self.last_start = len(self.tokens)
        self.tokens += turn.output_ids
        self.mask += [int(trained)] * len(turn.output_ids)
        self.logprobs += turn.logprobs if trained else [0.0] * len(turn.output_ids)
        self.turns.append(turn)
        self.last = turn

    def sample(self, leaf: int, max_seq_len: int | None) -> Assembled | None:
        if not any(self.mask[self.lead:]) or (max_seq_len is not None and self.lead >= max_seq_len):
            return None
        tokens, mask, logprobs = self.tokens, self.mask[self.lead:], self.logprobs[self.lead:]
        turns = self.turns
        status = FINISH_STATUS.get(turns[-1].finish or "abort", SampleStatus.ABORTED)
        if max_seq_len is not None and len(tokens) > max_seq_len:
            tokens, cut = tokens[:max_seq_len], max_seq_len - self.lead
            mask, logprobs = mask[:cut], logprobs[:cut]
            status = SampleStatus.TRUNCATED
            # a turn's answer starts at its prompt length here too (the held tokens were its prompt ids)
            turns = [turn for turn in turns if turn.prompt_len < max_seq_len]
        return Assembled(tokens=list(tokens), response_length=len(tokens) - self.lead, loss_mask=list(mask),
                         rollout_log_probs=list(logprobs), status=status,
                         weight_versions=[t.weight_version or "" for t in turns], turns=len(turns), leaf=leaf,
                         images=_turn_images(self.turns[-1]))


def _turn_images(turn: Turn) -> list[str]:
    """The image parts' URLs of the messages `turn` was asked with (the server took only data URLs)."""
    assert turn.node.parent is not None
    urls = []
    for node in turn.node.parent.path():
        content = (node.message or {}).get("content")
        for part in content if isinstance(content, list) else []:
            if isinstance(part, dict) and part.get("type") == "image_url":
                value = part.get("image_url")
                urls.append(str(value.get("url") if isinstance(value, dict) else value))
    return urls


def _chain(leaf: Node) -> list[Turn]:
    """The generated turns from the root to `leaf`, up to and including the first not finished by `stop`."""
    turns = []
    for node in leaf.path():
        if node.turn is not None:
            turns.append(node.turn)
            if node.turn.finish != "stop":
                break
    return turns


def assemble_all(session: Session, *, max_seq_len: int | None = None) -> list[Assembled]:
    """The samples of a session's tree: for each leaf, its turns laid end to end (forking where a prompt does not
    extend the tokens held); each generated token trained in exactly one of them."""
    trained: set[int] = set()
    samples: list[Assembled] = []
    for number, leaf in enumerate(leaf for leaf in session.root.leaves() if leaf is not session.root):
        builders: list[_Builder] = []
        for turn in _chain(leaf):
            if not builders or not builders[-1].absorbs(turn, session.fork_threshold):
                builders.append(_Builder(turn))
            builders[-1].answer(turn, trained=turn.index not in trained)
            trained.add(turn.index)
        samples += [s for b in builders if (s := b.sample(number, max_seq_len)) is not None]
    return samples


def assemble(session: Session, *, max_seq_len: int | None = None) -> Assembled | None:
    """The first sample of a session (a linear session has exactly one); None when it has none."""
    samples = assemble_all(session, max_seq_len=max_seq_len)
    return samples[0] if samples else None
