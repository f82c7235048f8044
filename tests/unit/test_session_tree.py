"""A session's turns as a message tree, and its samples (one per leaf), on the tiny model's tokenizer: a sub-agent
and a compacted history branch the tree; a rewritten short answer is merged away; a shared turn trains once; a
prompt that drifts inside the last answer realigns and one that drifts earlier forks; each sample equals a
reference built from the recorded turns alone; a 1,000-turn session and 10,000 sessions stay within their bounds."""

from __future__ import annotations

import tracemalloc
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from coordinator.engines.client import EngineClient
from coordinator.rollout.dispatch import Dispatcher
from coordinator.sessions.server import SessionServer
from coordinator.sessions.tito import strict_matches, tito_tokenizer
from coordinator.sessions.trajectory import (
    Assembled,
    Mount,
    Session,
    SessionBounds,
    SessionFull,
    Turn,
    assemble_all,
)
from workers.boundary.http_gates import HttpReply

END = "<|im_end|>"


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


def _template(tokenizer: Any, messages: list[dict[str, Any]]) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


class Agent:
    """Plays an agent's calls into one session as the session server records them (qwen3 family)."""

    def __init__(self, tokenizer: Any, session: Session | None = None) -> None:
        self.tokenizer = tokenizer
        self.session = session or Session()
        self.tito = tito_tokenizer("qwen3", tokenizer)
        self.recorded: list[tuple[list[int], list[int], list[float]]] = []

    def call(self, messages: list[dict[str, Any]], reply: str, finish: str = "stop") -> dict[str, Any]:
        prompt, mount = self.session.prompt_ids(messages, None, self.tito, strict_matches)
        output = self.tokenizer.encode(reply, add_special_tokens=False)
        logprobs = [-0.25 - 0.01 * len(self.recorded) - 0.001 * i for i in range(len(output))]
        text = self.tokenizer.decode(output, skip_special_tokens=True)
        message = {"role": "assistant", "content": text}
        self.session.record(kept=mount, prompt_ids=prompt, messages=messages, reply=message, output_ids=output,
                            logprobs=logprobs, finish=finish, weight_version=str(len(self.recorded)), record={})
        self.recorded.append((prompt, output, logprobs))
        return message


def reference(recorded: list[tuple[list[int], list[int], list[float]]], turns: list[int],
              trained: set[int]) -> tuple[list[int], list[int], list[float]]:
    """A leaf's sample from the recorded (prompt, output, logprobs) of its turns alone, when each prompt extends the
    previous turn's ids: the last prompt and output, mask 1 and the logprobs on the answers `trained` holds."""
    tokens = recorded[turns[-1]][0] + recorded[turns[-1]][1]
    start = len(recorded[turns[0]][0])
    mask, logprobs = [0] * (len(tokens) - start), [0.0] * (len(tokens) - start)
    for index in turns:
        prompt, output, values = recorded[index]
        assert tokens[len(prompt):len(prompt) + len(output)] == output
        if index in trained:
            for offset, value in enumerate(values):
                mask[len(prompt) - start + offset], logprobs[len(prompt) - start + offset] = 1, value
    return tokens, mask, logprobs


def same(sample: Assembled, expected: tuple[list[int], list[int], list[float]]) -> bool:
    return (sample.tokens, sample.loss_mask, sample.rollout_log_probs) == expected


def test_a_sub_agent_is_its_own_leaf_and_the_main_conversation_stays_token_in_token_out(tokenizer: Any) -> None:
    agent = Agent(tokenizer)
    main = [{"role": "system", "content": "orchestrate"}, {"role": "user", "content": "task"}]
    first = agent.call(main, "delegate" + END)
    sub = [{"role": "system", "content": "you are a sub-agent"}, {"role": "user", "content": "subtask"}]
    sub_reply = agent.call(sub, "sub result" + END)
    history = [*main, first, {"role": "tool", "content": sub_reply["content"]}]
    last = agent.call(history, "done" + END)
    assert agent.session.leaves() == 2
    main_sample, sub_sample = assemble_all(agent.session)
    assert same(main_sample, reference(agent.recorded, [0, 2], {0, 1, 2}))
    assert same(sub_sample, reference(agent.recorded, [1], {0, 1, 2}))
    # each leaf decodes to exactly its conversation, as the chat template writes it (qwen3: ids equal)
    assert main_sample.tokens == _template(tokenizer, history) + agent.recorded[2][1]
    assert tokenizer.decode(sub_sample.tokens).endswith("subtask<|im_end|>\n<|im_start|>assistant\nsub result" + END)
    assert main_sample.turns == 2 and sub_sample.turns == 1 and last["content"] == "done"


def test_a_compacted_history_branches_and_each_branch_continues(tokenizer: Any) -> None:
    agent = Agent(tokenizer)
    system = {"role": "system", "content": "code"}
    one = [system, {"role": "user", "content": "q1"}]
    a1 = agent.call(one, "a1" + END)
    two = [*one, a1, {"role": "user", "content": "q2"}]
    a2 = agent.call(two, "a2" + END)
    compacted = [system, {"role": "user", "content": f"summary: q1 {a1['content']} q2 {a2['content']}"}]
    a3 = agent.call(compacted, "a3" + END)
    agent.call([*compacted, a3, {"role": "user", "content": "q4"}], "a4" + END)
    assert agent.session.leaves() == 2
    before, after = assemble_all(agent.session)
    assert same(before, reference(agent.recorded, [0, 1], {0, 1, 2, 3}))
    assert same(after, reference(agent.recorded, [2, 3], {0, 1, 2, 3}))
    assert [before.weight_versions, after.weight_versions] == [["0", "1"], ["2", "3"]]


def test_a_shared_turn_trains_once_and_a_rewritten_short_answer_is_merged_away(tokenizer: Any) -> None:
    agent = Agent(tokenizer)
    ask = [{"role": "user", "content": "go"}]
    a1 = agent.call(ask, "a1" + END)
    agent.call([*ask, a1, {"role": "user", "content": "x"}], "b" + END)
    agent.call([*ask, a1, {"role": "user", "content": "y"}], "c" + END)
    left, right = assemble_all(agent.session)
    assert same(left, reference(agent.recorded, [0, 1], {0, 1}))
    assert same(right, reference(agent.recorded, [0, 2], {2}))  # a1 is context here: trained on the left
    assert sum(left.loss_mask) + sum(right.loss_mask) == sum(len(o) for _, o, _ in agent.recorded)

    merged = Agent(tokenizer)
    merged.call(ask, "ab" + END)
    rewritten = [*ask, {"role": "assistant", "content": "ab, edited"}, {"role": "user", "content": "next"}]
    merged.call(rewritten, "z" + END)
    (only,) = assemble_all(merged.session)
    assert merged.session.leaves() == 1 and merged.recorded[1][0] == _template(tokenizer, rewritten)
    assert same(only, reference(merged.recorded, [1], {1}))  # the abandoned answer is not trained


def _record(session: Session, after: Turn | None, prompt: list[int], output: list[int]) -> Turn:
    node = after.node if after is not None else session.root
    return session.record(kept=Mount(node, 0, None), prompt_ids=prompt, messages=[], reply={"role": "assistant"},
                          output_ids=output, logprobs=[-1.0] * len(output), finish="stop", weight_version=None,
                          record={})


def test_drift_inside_the_last_answer_realigns_and_earlier_drift_forks() -> None:
    session = Session(fork_threshold=4)
    first = _record(session, None, [1, 2, 3], [10, 11, 12])
    _record(session, first, [1, 2, 3, 10, 99, 7], [20])  # drifted inside answer 1, short answer: REALIGN
    (sample,) = assemble_all(session)
    assert sample.tokens == [1, 2, 3, 10, 99, 7, 20] and sample.loss_mask == [0, 0, 0, 1]

    forked = Session(fork_threshold=4)
    first = _record(forked, None, [1, 2, 3], [10, 11, 12])
    _record(forked, first, [1, 5, 3, 10, 11, 12, 7], [20])  # drifted inside the prompt: FORK
    one, two = assemble_all(forked)
    assert (one.tokens, one.loss_mask) == ([1, 2, 3, 10, 11, 12], [1, 1, 1])
    assert (two.tokens, two.loss_mask) == ([1, 5, 3, 10, 11, 12, 7, 20], [1])

    long_answer = Session(fork_threshold=1)  # a drifted turn with an answer this long forks as well
    first = _record(long_answer, None, [1, 2, 3], [10, 11, 12])
    _record(long_answer, first, [1, 2, 3, 10, 99, 7], [20])
    assert len(assemble_all(long_answer)) == 2


def test_a_thousand_turn_session_stays_within_its_bounds(tokenizer: Any) -> None:
    agent = Agent(tokenizer, Session(bounds=SessionBounds(max_turns=1000)))
    messages: list[dict[str, Any]] = [{"role": "user", "content": "start"}]
    for index in range(1000):
        reply = agent.call(messages, f"ok{index % 10}" + END)
        messages = [*messages, reply, {"role": "tool", "content": str(index)}]
    session = agent.session
    (sample,) = assemble_all(session)
    assert sample.turns == 1000 and sample.tokens == agent.recorded[-1][0] + agent.recorded[-1][1]
    # every token stored once: the session's store is the sample's length, not turns x tokens
    assert session.tokens == len(sample.tokens) and session.nodes == len(messages) - 1  # the last tool is unsent
    with pytest.raises(SessionFull, match="1000 turns"):
        agent.call(messages, "over" + END)
    assert len(session.turns) == 1000 and session.nodes == len(messages) - 1
    tight = Agent(tokenizer, Session(bounds=SessionBounds(max_tokens=40)))
    with pytest.raises(SessionFull, match="stored tokens"):
        tight.call([{"role": "user", "content": "a long question " * 8}], "x")
    assert tight.session.turns == [] and tight.session.tokens == 0


async def test_ten_thousand_sessions_are_held_in_bounded_memory_and_the_next_is_refused(tokenizer: Any) -> None:
    async with EngineClient(max_connections=1) as client:
        # a router address no request reaches: creating a session contacts no engine
        server = SessionServer(dispatcher=Dispatcher(client=client, pool=None, router_url="http://127.0.0.1:9"),
                               tito=tito_tokenizer("qwen3", tokenizer), matcher=strict_matches, max_sessions=10_000)
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            for _ in range(10_000):
                await server.create()
            held = tracemalloc.get_traced_memory()[0] - before
        finally:
            tracemalloc.stop()
        assert held / 10_000 < 4096, f"{held / 10_000:.0f} bytes per empty session"
        with pytest.raises(HttpReply) as refused:
            await server.create()
        assert refused.value.status == 503 and "10000 sessions" in str(refused.value)
