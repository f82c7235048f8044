"""The session server's token-in-token-out rules on the tiny model's tokenizer (a Qwen-style chat template):
the `qwen3` family reproduces the template's own ids when a turn ends at `<|im_end|>`, `default` keeps exactly
the generated ids; the matchers; and how a session's turns become one sample (mask, logprobs, the first
non-`stop` turn ending it, `max_seq_len`, retries and rewritten history as branches)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from coordinator.sessions.tito import (
    SessionRequestError,
    resolve_matcher,
    role_content_matches,
    strict_matches,
    tito_tokenizer,
)
from coordinator.sessions.trajectory import Session, assemble, assemble_all
from replay.sample import SampleStatus

ASK = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2"}]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


def _template(tokenizer: Any, messages: list[dict[str, Any]]) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def _turn(session: Session, tokenizer: Any, family: str, messages: list[dict[str, Any]], reply: str,
          finish: str = "stop") -> tuple[list[int], list[int], list[float]]:
    """One recorded turn whose engine wrote `reply`: (its prompt ids, output ids, logprobs)."""
    tito = tito_tokenizer(family, tokenizer)
    prompt, kept = session.prompt_ids(messages, None, tito, strict_matches)
    output = tokenizer.encode(reply, add_special_tokens=False)
    text = tokenizer.decode(output, skip_special_tokens=True)
    logprobs = [-0.5 - i for i in range(len(output))]
    session.record(kept=kept, prompt_ids=prompt, messages=messages, reply={"role": "assistant", "content": text},
                   output_ids=output, logprobs=logprobs, finish=finish, weight_version=str(len(session.turns)),
                   record={"request": {"max_tokens": 9}})
    return prompt, output, logprobs


def test_qwen3_family_matches_the_template_and_default_keeps_the_generated_ids(tokenizer: Any) -> None:
    history = [*ASK, {"role": "assistant", "content": "4"}, {"role": "tool", "content": "ok"}]
    for family, expected in (("qwen3", _template(tokenizer, history)), ("default", None)):
        session = Session()
        first_prompt, first_output, _ = _turn(session, tokenizer, family, ASK, "4<|im_end|>")
        assert first_prompt == _template(tokenizer, ASK)
        second_prompt, _, _ = _turn(session, tokenizer, family, history, "5")
        assert second_prompt[: len(first_prompt) + len(first_output)] == first_prompt + first_output
        if expected is not None:
            assert second_prompt == expected  # the newline after <|im_end|> the model stopped before
        else:
            assert second_prompt != _template(tokenizer, history)  # default: no newline inserted
            assert len(second_prompt) == len(_template(tokenizer, history)) - 1
        records = session.describe()  # the records get their prompt ids and messages back
        assert [r["request"]["input_ids"] for r in records] == [first_prompt, second_prompt]
        assert records[1]["request"]["messages"] == history and records[1]["request"]["max_tokens"] == 9


def test_assembled_sample_masks_exactly_the_generated_tokens(tokenizer: Any) -> None:
    session = Session()
    first_prompt, first_output, first_logprobs = _turn(session, tokenizer, "qwen3", ASK, "ab<|im_end|>")
    second_prompt, second_output, second_logprobs = _turn(
        session, tokenizer, "qwen3", [*ASK, {"role": "assistant", "content": "ab"}, {"role": "user", "content": "and?"}],
        "cde", finish="length")
    sample = assemble(session)
    assert sample is not None and sample.turns == 2
    assert sample.tokens == second_prompt + second_output
    start = len(first_prompt)
    between = len(second_prompt) - start - len(first_output)
    assert sample.loss_mask == [1] * 3 + [0] * between + [1] * 3
    assert sample.rollout_log_probs == first_logprobs + [0.0] * between + second_logprobs
    assert sample.status is SampleStatus.TRUNCATED and sample.weight_versions == ["0", "1"]
    cut = assemble(session, max_seq_len=start + 2)
    assert cut is not None and cut.loss_mask == [1, 1] and cut.status is SampleStatus.TRUNCATED
    assert assemble(session, max_seq_len=start) is None  # the prompt alone fills it


def test_the_first_turn_not_ending_in_stop_ends_the_trajectory(tokenizer: Any) -> None:
    session = Session()
    _turn(session, tokenizer, "default", ASK, "ab", finish="length")
    _turn(session, tokenizer, "default", [*ASK, {"role": "assistant", "content": "ab"},
                                          {"role": "user", "content": "more"}], "c")
    sample = assemble(session)
    assert sample is not None and sample.turns == 1 and sample.loss_mask == [1, 1]


def test_retries_branch_and_appended_assistants_render_afresh(tokenizer: Any) -> None:
    session = Session()
    _turn(session, tokenizer, "default", ASK, "ab")
    retry, _, _ = _turn(session, tokenizer, "default", ASK, "xy")  # the same first request again: a sibling leaf
    assert len(session.turns) == 2 and session.leaves() == 2 and retry == _template(tokenizer, ASK)
    # history with an assistant message this session never generated: the template over all of it, a new branch
    foreign = [*ASK, {"role": "assistant", "content": "xy"}, {"role": "assistant", "content": "?"}]
    prompt, output, _ = _turn(session, tokenizer, "default", foreign, "1")
    assert prompt == _template(tokenizer, foreign) and session.leaves() == 2  # it hangs below the "xy" answer
    first, second = assemble_all(session)
    assert sum(first.loss_mask) == len(tokenizer.encode("ab", add_special_tokens=False))
    # "xy" and "1" in one sample: the fresh render of its history extends the "xy" turn's exact ids
    xy = tokenizer.encode("xy", add_special_tokens=False)
    assert second.tokens == prompt + output and sum(second.loss_mask) == len(xy) + len(output)
    assert second.turns == 2 and assemble(Session()) is None


def test_matchers() -> None:
    stored = {"role": "assistant", "content": "hi", "tool_calls": [
        {"id": "a", "index": 0, "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}]}
    replayed = {"role": "assistant", "content": [{"type": "text", "text": "hi"}], "tool_calls": [
        {"id": "b", "type": "function", "function": {"name": "f", "arguments": '{"x":1}'}}]}
    assert strict_matches(stored, replayed)
    assert not strict_matches(stored, {**replayed, "tool_calls": None})
    assert role_content_matches(stored, {"role": "assistant", "content": "hi"})
    assert resolve_matcher("strict") is strict_matches
    assert resolve_matcher("coordinator.sessions.tito:role_content_matches") is role_content_matches


def test_content_parts_and_null_content_render_as_the_engine_renders_them(tokenizer: Any) -> None:
    session = Session()
    parts = [{"role": "user", "content": [{"type": "text", "text": "2+"}, {"type": "text", "text": "2"}]}]
    prompt, _, _ = _turn(session, tokenizer, "default", parts, "4")
    assert prompt == _template(tokenizer, [{"role": "user", "content": "2+\n2"}])
    with pytest.raises(SessionRequestError, match="only text parts"):
        Session().prompt_ids([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], None,
                             tito_tokenizer("default", tokenizer), strict_matches)
