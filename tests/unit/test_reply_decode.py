"""Reading a `/generate` answer from its bytes (coordinator.engines.reply_decode) gives the generic path's verdict.

The generic path is bounded `decode_json` then `check_generate_body`; for any SGLang-shaped answer (one reply or a
batch, logprobs asked or not), any one mutation of a type, length or range, and the shapes only the generic path
reads, both return the same checked replies, or both refuse with the same message. An answer of SGLang's shape is
decoded once: into the typed schema, never also into plain JSON.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.engines import reply_decode
from coordinator.engines.bounded import limits_for
from coordinator.engines.errors import EngineReplyError
from coordinator.engines.replies import GenerateReply, check_generate_body
from coordinator.engines.reply_decode import read_generate_answer, read_generate_answer_async
from tests.unit.test_engine_replies import MUTATIONS, URL, VOCAB, replies
from workers.boundary.json_input import decode_json

LIMITS = limits_for(1 << 20)
SOURCE = URL + "/generate"


def generic(raw: bytes, payload: dict[str, Any]) -> tuple[Any, Any]:
    try:
        value = decode_json(raw, f"engine {SOURCE}", LIMITS)
    except Exception as exc:
        return "refused", str(EngineReplyError(SOURCE, getattr(exc, "reason", str(exc))))
    try:
        return value, tuple(check_generate_body(value, URL, payload, VOCAB))
    except EngineReplyError as exc:
        return "refused", str(exc)


def verdict(raw: bytes, payload: dict[str, Any]) -> tuple[Any, Any]:
    """(the JSON the answer's bytes hold, its checked replies), or ("refused", the message)."""
    try:
        answer = read_generate_answer(raw, URL, payload, VOCAB, LIMITS, source=SOURCE)
    except EngineReplyError as exc:
        return "refused", str(exc)
    assert answer.body is raw  # the bytes are kept as they came, for a forwarder
    return json.loads(raw), answer.replies


def payload_for(count: int, logprobs: bool) -> dict[str, Any]:
    return {"input_ids": [[1, 2]] * count if count > 1 else [1, 2], "return_logprob": logprobs,
            "sampling_params": {"max_new_tokens": 16}}


@settings(max_examples=80, deadline=None)
@given(st.lists(replies(), min_size=1, max_size=3), st.booleans())
def test_sglang_shaped_answers_read_as_the_generic_path_reads_them(batch: list[dict[str, Any]],
                                                                     logprobs: bool) -> None:
    body = batch[0] if len(batch) == 1 else batch
    raw = json.dumps(body).encode()
    value, checked = verdict(raw, payload_for(len(batch), logprobs))
    assert value == body
    assert (value, checked) == generic(raw, payload_for(len(batch), logprobs))


@settings(max_examples=160, deadline=None)
@given(replies(), st.sampled_from(sorted(MUTATIONS)), st.integers(0, 2))
def test_any_mutation_gets_the_generic_paths_refusal_word_for_word(reply: dict[str, Any], name: str,
                                                                   position: int) -> None:
    MUTATIONS[name](reply)
    batch = [reply] * (position + 1)  # position 0: a reply alone, else a batch of that many
    body = reply if position == 0 else batch
    raw = json.dumps(body).encode()
    outcome = verdict(raw, payload_for(len(batch), True))
    assert outcome[0] == "refused" and URL in outcome[1]
    assert outcome == generic(raw, payload_for(len(batch), True))


@pytest.mark.parametrize("body", [
    # before SGLang 0.5.1: no output_ids, the ids are read from the triples
    {"text": "a", "meta_info": {"finish_reason": {"type": "length", "length": 2},
                                "output_token_logprobs": [[-0.1, 7, None], [-0.2, 8, None]]}},
    # two-element pairs and no text
    {"output_ids": [7], "meta_info": {"finish_reason": {"type": "stop", "matched": 7},
                                      "output_token_logprobs": [[-0.1, 7]]}},
    # an abort ends empty; input logprobs start with null
    {"text": "", "output_ids": [], "meta_info": {"finish_reason": {"type": "abort", "message": "paused",
                                                                   "status_code": 503, "err_type": None},
                                                 "input_token_logprobs": [[None, 1, None], [-0.3, 2, "x"]]}},
    [],
])
def test_shapes_outside_the_typed_cover_are_read_by_the_generic_path(body: Any) -> None:
    raw = json.dumps(body).encode()
    outcome = verdict(raw, payload_for(1, False))
    assert outcome[0] != "refused", outcome
    assert outcome == generic(raw, payload_for(1, False))


def test_fields_sglang_adds_pass_through_and_none_of_them_may_nest_past_the_limit() -> None:
    reply = {"text": "a", "output_ids": [3], "meta_info": {
        "finish_reason": {"type": "stop", "matched": 3}, "routed_experts": [[1, 2], [3, 4]],
        "cached_tokens_details": {"device": 0, "host": 0}}, "hidden_states": [[0.5, 0.25]]}
    raw = json.dumps(reply).encode()
    value, (checked,) = verdict(raw, payload_for(1, False))
    assert value == reply and checked.output_ids == (3,)
    depth = LIMITS.max_depth
    reply["meta_info"]["routed_experts"] = json.loads("[" * depth + "]" * depth)
    refused = verdict(json.dumps(reply).encode(), payload_for(1, False))
    assert refused[0] == "refused" and f"deeper than {depth}" in refused[1]
    assert refused == generic(json.dumps(reply).encode(), payload_for(1, False))


async def test_a_large_answer_is_read_off_the_loop_with_the_same_verdict() -> None:
    ids = [i % VOCAB for i in range(60_000)]  # > 1 MiB of JSON
    reply = {"text": "x", "output_ids": ids, "meta_info": {"finish_reason": {"type": "length", "length": len(ids)},
                                                           "output_token_logprobs": [[-0.5, i, None] for i in ids]}}
    raw = json.dumps(reply).encode()
    limits = limits_for(len(raw) + 1)
    answer = await read_generate_answer_async(raw, URL, payload_for(1, True), VOCAB, limits)
    (checked,) = answer.replies
    assert answer.body == raw and checked.output_ids == tuple(ids)
    reply["output_ids"][-1] = VOCAB
    with pytest.raises(EngineReplyError, match=f"token id {VOCAB}, outside the vocabulary"):
        await read_generate_answer_async(json.dumps(reply).encode(), URL, payload_for(1, True), VOCAB, limits)


def test_an_sglang_shaped_answer_is_decoded_once_and_never_into_plain_json(monkeypatch: pytest.MonkeyPatch) -> None:
    """A second decode of the same bytes (the plain JSON beside the typed schema, as before) fails this test."""
    calls: list[str] = []
    typed = reply_decode._ANSWER

    class CountingDecoder:
        def decode(self, raw: bytes) -> Any:
            calls.append("typed")
            return typed.decode(raw)

    plain = msgspec.json.decode

    def counting_plain(raw: bytes, *args: Any, **kwargs: Any) -> Any:
        calls.append("plain")
        return plain(raw, *args, **kwargs)

    monkeypatch.setattr(reply_decode, "_ANSWER", CountingDecoder())
    monkeypatch.setattr(msgspec.json, "decode", counting_plain)
    reply = {"text": "ab", "output_ids": [3, 4], "meta_info": {
        "id": "r1", "finish_reason": {"type": "length", "length": 2}, "weight_version": "7",
        "output_token_logprobs": [[-0.5, 3, "a"], [-0.25, 4, "b"]], "routed_experts": [[1, 2]] * 40}}
    for body in (reply, [reply, reply]):
        calls.clear()
        answer = read_generate_answer(json.dumps(body).encode(), URL, payload_for(1 if body is reply else 2, True),
                                      VOCAB, LIMITS, source=SOURCE)
        assert calls == ["typed"]
        assert all(type(r) is GenerateReply and r.logprobs == (-0.5, -0.25) and r.weight_version == "7"
                   for r in answer.replies)
    calls.clear()  # outside the typed cover (no output_ids: SGLang before 0.5.1) the generic path decodes it
    old = {"text": "a", "meta_info": {"finish_reason": {"type": "length", "length": 1},
                                      "output_token_logprobs": [[-0.1, 7, None]]}}
    (checked,) = read_generate_answer(json.dumps(old).encode(), URL, payload_for(1, True), VOCAB, LIMITS).replies
    assert calls == ["typed", "plain"] and checked.output_ids == (7,)
