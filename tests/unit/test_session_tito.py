"""The session server's token-in-token-out rules on the tiny model's tokenizer (a Qwen-style chat template):
the `qwen3` family reproduces the template's own ids when a turn ends at `<|im_end|>`, `default` keeps exactly
the generated ids; the matchers; and how a session's turns become one sample (mask, logprobs, the first
non-`stop` turn ending it, `max_seq_len`, retries and rewritten history as branches)."""

from __future__ import annotations

import re
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


# Each of miles' families, on the tiny tokenizer given the family's boundary tokens and a template with its
# layout: the second turn's ids (stored prompt + generated ids + appended suffix) equal the template's own render
# of the whole history, i.e. the family fixes exactly its boundary. `reply` is what the model generated, ending
# at the family's stop token.
_QWEN = None  # the tiny model's own template is Qwen's: `<|im_start|>role\n...<|im_end|>\n`
_MINIMAX = ("{% for m in messages %}{{ ']~b]' + ('ai' if m.role == 'assistant' else m.role) + '\\n' + m.content "
            "+ '[e~[\\n' }}{% endfor %}{% if add_generation_prompt %}{{ ']~b]ai\\n' }}{% endif %}")
_GLM = ("[gMASK]{% for m in messages %}{{ '<|' + ('observation' if m.role == 'tool' else m.role) + '|>\\n' + "
        "m.content }}{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}")
_KIMI = ("{% for m in messages %}{{ ('<|im_assistant|>' if m.role == 'assistant' else '<|im_user|>' if m.role == "
         "'user' else '<|im_system|>') + m.role + '<|im_middle|>' + m.content + '<|im_end|>' }}{% endfor %}"
         "{% if add_generation_prompt %}{{ '<|im_assistant|>assistant<|im_middle|>' }}{% endif %}")
_INKLING = ("{% for m in messages %}{{ '<|message_' + ('model' if m.role == 'assistant' else m.role) + '|>' + "
            "m.content + '<|end_message|>' }}{% endfor %}{% if add_generation_prompt %}{{ '<|message_model|>' }}"
            "{% endif %}")
FAMILY_LAYOUTS = {  # family: (template, its special tokens, the model's reply, the appended message's role)
    "qwen3": (_QWEN, [], "4<|im_end|>", "tool"),
    "qwen35": (_QWEN, [], "4<|im_end|>", "user"),
    "qwennext": (_QWEN, [], "4<|im_end|>", "tool"),
    "nemotron3": (_QWEN, [], "4<|im_end|>", "user"),
    "minimax_m25": (_MINIMAX, ["]~b]", "[e~["], "4[e~[", "tool"),
    "minimax_m27": (_MINIMAX, ["]~b]", "[e~["], "4[e~[", "user"),
    "glm47": (_GLM, ["<|system|>", "<|user|>", "<|assistant|>", "<|observation|>"], "4<|observation|>", "tool"),
    "kimi25": (_KIMI, ["<|im_system|>", "<|im_user|>", "<|im_assistant|>", "<|im_middle|>"], "4<|im_end|>", "tool"),
    "kimi26": (_KIMI, ["<|im_system|>", "<|im_user|>", "<|im_assistant|>", "<|im_middle|>"], "4<|im_end|>", "user"),
    "inkling": (_INKLING, ["<|message_system|>", "<|message_user|>", "<|message_model|>", "<|message_tool|>",
                           "<|end_message|>"], "4<|end_message|>", "tool"),
}


def _family_tokenizer(tiny_model_dir: Path, template: str | None, specials: list[str]) -> Any:
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    if specials:
        tokenizer.add_special_tokens({"additional_special_tokens": specials})
    if template is not None:
        tokenizer.chat_template = template
    return tokenizer


@pytest.mark.parametrize("family", sorted(FAMILY_LAYOUTS))
def test_each_miles_family_fixes_its_boundary_to_the_templates_own_ids(tiny_model_dir: Path, family: str) -> None:
    template, specials, reply, role = FAMILY_LAYOUTS[family]
    tokenizer = _family_tokenizer(tiny_model_dir, template, specials)
    history = [*ASK, {"role": "assistant", "content": "4"}, {"role": role, "content": "ok"}]
    session = Session()
    first_prompt, first_output, _ = _turn(session, tokenizer, family, ASK, reply)
    second_prompt, _, _ = _turn(session, tokenizer, family, history, "5")
    assert second_prompt == _template(tokenizer, history)
    # The generated ids are kept as they are, but for the one boundary token a family may drop (glm47).
    kept = len(first_prompt) + len(first_output) - (family == "glm47")
    assert second_prompt[:kept] == (first_prompt + first_output)[:kept]
    if family in ("glm47", "minimax_m25", "minimax_m27"):
        # default leaves the boundary as generated, so its ids differ from the template's
        plain = Session()
        _turn(plain, tokenizer, "default", ASK, reply)
        assert _turn(plain, tokenizer, "default", history, "5")[0] != _template(tokenizer, history)


def test_families_pin_their_template_kwargs_and_narrow_appended_roles(tiny_model_dir: Path) -> None:
    tokenizer = _family_tokenizer(tiny_model_dir, _KIMI, FAMILY_LAYOUTS["kimi25"][1])
    assert tito_tokenizer("kimi25", tokenizer).chat_template_kwargs == {"preserve_thinking": True}
    assert tito_tokenizer("qwen35", tokenizer, {"enable_thinking": True}).chat_template_kwargs == {
        "enable_thinking": True, "clear_thinking": False}
    with pytest.raises(ValueError, match="clear_thinking=True conflicts"):
        tito_tokenizer("qwennext", tokenizer, {"clear_thinking": True})
    with pytest.raises(ValueError, match=re.escape("no single token '<|observation|>'")):
        tito_tokenizer("glm47", tokenizer)  # not a GLM tokenizer
    session = Session()
    _turn(session, tokenizer, "qwen35", ASK, "4<|im_end|>")
    with pytest.raises(SessionRequestError, match=r"\['tool', 'user'\] \(--tito-model qwen35\), got 'system'"):
        session.prompt_ids([*ASK, {"role": "assistant", "content": "4"}, {"role": "system", "content": "x"}], None,
                           tito_tokenizer("qwen35", tokenizer), strict_matches)
