"""The `/generate` reply check (coordinator.engines.replies) and the reply caps (coordinator.engines.bounded).

Property-based: any SGLang-shaped reply (the shapes of SGLang's tokenizer manager and finish reasons) passes
unchanged and its typed view carries the same ids and logprobs; any one mutation of a type, a length or a range
is refused as an `EngineReplyError` (a `BoundaryError`) naming the peer.
"""

from __future__ import annotations

import copy
import json
import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.engines.bounded import (
    BYTES_PER_TOKEN,
    DEFAULT_REPLY_BYTES,
    DEFAULT_TOKENS,
    chat_reply_limit,
    generate_reply_limit,
)
from coordinator.engines.errors import EngineReplyError
from coordinator.engines.replies import (
    ReplyRules,
    check_chat_reply,
    check_generate_body,
    check_generate_body_async,
    check_generate_reply,
)
from workers.boundary.errors import BoundaryError

URL = "http://127.0.0.1:31999"
VOCAB = 1000
RULES = ReplyRules(vocab_size=VOCAB, logprobs=True, expect_tokens=True)

finishes = st.one_of(
    st.builds(lambda m: {"type": "stop", "matched": m},
              st.one_of(st.integers(0, VOCAB - 1), st.text(max_size=5), st.lists(st.integers(0, VOCAB - 1), max_size=3))),
    st.builds(lambda n: {"type": "length", "length": n}, st.integers(1, 64)),
    st.builds(lambda msg: {"type": "abort", "message": msg, "status_code": None, "err_type": None},
              st.text(max_size=20)),
)
logprob = st.floats(min_value=-50, max_value=0, allow_nan=False)


@st.composite
def replies(draw: st.DrawFn) -> dict[str, Any]:
    ids = draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=20))
    lps = draw(st.lists(logprob, min_size=len(ids), max_size=len(ids)))
    texts = draw(st.lists(st.one_of(st.none(), st.text(max_size=4)), min_size=len(ids), max_size=len(ids)))
    meta: dict[str, Any] = {
        "id": draw(st.text(max_size=8)), "finish_reason": draw(finishes), "prompt_tokens": draw(st.integers(0, 99)),
        "completion_tokens": len(ids), "cached_tokens": 0, "weight_version": draw(st.sampled_from(["default", "3"])),
        "e2e_latency": draw(st.floats(0, 100)),
        "output_token_logprobs": [[lp, i, t] for lp, i, t in zip(lps, ids, texts, strict=True)],
    }
    if draw(st.booleans()):
        meta["input_token_logprobs"] = [[None, 1, None], [draw(logprob), 2, None]]
    return {"text": draw(st.text(max_size=30)), "output_ids": ids, "meta_info": meta}


@settings(max_examples=80, deadline=None)
@given(replies())
def test_every_sglang_shaped_reply_passes_unchanged(reply: dict[str, Any]) -> None:
    before = copy.deepcopy(reply)
    typed = check_generate_reply(reply, URL, RULES)
    assert reply == before
    assert typed.output_ids == tuple(reply["output_ids"])
    assert typed.logprobs == tuple(t[0] for t in reply["meta_info"]["output_token_logprobs"])
    assert typed.finish is not None and typed.finish.type == reply["meta_info"]["finish_reason"]["type"]


def _set_id(reply: dict[str, Any], value: Any) -> None:
    reply["output_ids"][0] = value


def _set_triple(index: int, value: Any) -> Any:
    def mutate(reply: dict[str, Any]) -> None:
        reply["meta_info"]["output_token_logprobs"][0][index] = value
    return mutate


MUTATIONS: dict[str, Any] = {
    "float id": lambda r: _set_id(r, r["output_ids"][0] + 0.5),
    "integral float id": lambda r: _set_id(r, float(r["output_ids"][0])),
    "bool id": lambda r: _set_id(r, True),
    "string id": lambda r: _set_id(r, "5"),
    "id past the vocabulary": lambda r: _set_id(r, VOCAB),
    "negative id": lambda r: _set_id(r, -1),
    "ids not a list": lambda r: r.update(output_ids={"0": 1}),
    "one logprob too few": lambda r: r["meta_info"]["output_token_logprobs"].pop(),
    "one logprob too many": lambda r: r["meta_info"]["output_token_logprobs"].append([-1.0, 1, None]),
    "one id too many": lambda r: r["output_ids"].append(1),
    "nan logprob": _set_triple(0, math.nan),
    "inf logprob": _set_triple(0, math.inf),
    "-inf logprob": _set_triple(0, -math.inf),
    "string logprob": _set_triple(0, "-0.1"),
    "triple id differs": lambda r: r["meta_info"]["output_token_logprobs"][0].__setitem__(1, (r["output_ids"][0] + 1) % VOCAB),
    "unknown finish type": lambda r: r["meta_info"]["finish_reason"].update(type="done"),
    "unhashable finish type": lambda r: r["meta_info"]["finish_reason"].update(type=["stop"]),
    "finish a string": lambda r: r["meta_info"].update(finish_reason="stop"),
    "finish null": lambda r: r["meta_info"].update(finish_reason=None),
    "text not a string": lambda r: r.update(text=["x"]),
    "meta not an object": lambda r: r.update(meta_info=[1]),
    "prompt_tokens a float": lambda r: r["meta_info"].update(prompt_tokens=3.0),
    "completion_tokens negative": lambda r: r["meta_info"].update(completion_tokens=-1),
    "weight_version an object": lambda r: r["meta_info"].update(weight_version={"v": 1}),
    "e2e_latency nan": lambda r: r["meta_info"].update(e2e_latency=math.nan),
    "no logprobs though asked": lambda r: r["meta_info"].pop("output_token_logprobs"),
    "empty though it ran": lambda r: (r.update(output_ids=[]), r["meta_info"].update(
        output_token_logprobs=[], finish_reason={"type": "length", "length": 0})),
}


@settings(max_examples=160, deadline=None)
@given(replies(), st.sampled_from(sorted(MUTATIONS)))
def test_any_mutation_of_type_length_or_range_is_refused_naming_the_peer(reply: dict[str, Any], name: str) -> None:
    MUTATIONS[name](reply)
    with pytest.raises(EngineReplyError) as caught:
        check_generate_reply(reply, URL, RULES)
    assert isinstance(caught.value, BoundaryError)
    assert caught.value.source == f"engine {URL}" and URL in str(caught.value)


def test_a_streamed_chunk_may_be_unfinished_and_an_abort_may_be_empty() -> None:
    chunk = {"text": None, "output_ids": [4], "meta_info": {"finish_reason": None,
                                                             "output_token_logprobs": [[-0.5, 4, None]]}}
    check_generate_reply(chunk, URL, ReplyRules(VOCAB, logprobs=True, stream=True))
    aborted = {"text": "", "output_ids": [], "meta_info": {"finish_reason": {"type": "abort", "message": "paused"}}}
    assert check_generate_reply(aborted, URL, ReplyRules(VOCAB, expect_tokens=True)).output_ids == ()
    with pytest.raises(EngineReplyError, match="null in a finished reply"):
        check_generate_reply(chunk, URL, ReplyRules(VOCAB, logprobs=True))


def test_a_batch_is_checked_reply_by_reply_with_each_prompts_own_flags() -> None:
    good = {"text": "a", "output_ids": [1], "meta_info": {"finish_reason": {"type": "stop", "matched": 1}}}
    payload = {"input_ids": [[1], [2]], "sampling_params": [{"max_new_tokens": 4}, {"max_new_tokens": 0}],
               "return_logprob": [False, False]}
    empty = {"text": "", "output_ids": [], "meta_info": {"finish_reason": {"type": "length", "length": 0}}}
    assert len(check_generate_body([good, empty], URL, payload, VOCAB)) == 2  # max_new_tokens 0: may be empty
    with pytest.raises(EngineReplyError, match="no output ids"):
        check_generate_body([empty, good], URL, payload, VOCAB)


def test_pre_0_5_1_replies_read_the_ids_from_the_logprob_triples() -> None:
    reply = {"text": "a", "meta_info": {"finish_reason": {"type": "length", "length": 2},
                                        "output_token_logprobs": [[-0.1, 7, None], [-0.2, 8, None]]}}
    assert check_generate_reply(reply, URL, RULES).output_ids == (7, 8)
    reply["meta_info"]["output_token_logprobs"][1][1] = 8.0
    with pytest.raises(EngineReplyError, match=r"token id 8\.0"):
        check_generate_reply(reply, URL, RULES)


def test_chat_answers_are_refused_on_what_the_session_trains_on() -> None:
    answer = {"choices": [{"finish_reason": "stop", "message": {"content": "hi"},
                           "meta_info": {"output_token_logprobs": [[-0.1, 3, "hi"]], "completion_tokens": 1}}]}
    check_chat_reply(answer, URL, VOCAB)
    answer["choices"][0]["meta_info"]["output_token_logprobs"][0][0] = math.nan
    with pytest.raises(EngineReplyError, match="finite"):
        check_chat_reply(answer, URL, VOCAB)
    with pytest.raises(EngineReplyError, match="choices"):
        check_chat_reply({"choices": []}, URL, VOCAB)


def test_the_reply_cap_follows_the_request() -> None:
    one = generate_reply_limit({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 8}})
    long = generate_reply_limit({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 8000}})
    batch = generate_reply_limit({"input_ids": [[1], [2], [3]], "sampling_params": [{"max_new_tokens": 8000}] * 3})
    assert one < long < batch and batch >= 3 * 8000 * BYTES_PER_TOKEN
    assert generate_reply_limit({"text": "hi"}) >= DEFAULT_TOKENS * BYTES_PER_TOKEN  # no budget: a default
    top = generate_reply_limit({"input_ids": [1], "sampling_params": {"max_new_tokens": 8000}, "top_logprobs_num": 5})
    assert top > long
    # An honest reply of the longest kind fits: 8000 tokens, each with a logprob triple and its text.
    ids = list(range(8000))
    honest = {"text": "\u00e9" * 8000, "output_ids": ids, "meta_info": {
        "finish_reason": {"type": "length", "length": 8000}, "id": "x" * 32,
        "output_token_logprobs": [[-12.345678901234567, i, "\u00e9"] for i in ids]}}
    assert len(json.dumps(honest).encode()) < long
    # A chat answer (the session server's): never below the control cap, and twice a generate's per token.
    assert chat_reply_limit(None) == chat_reply_limit({"max_tokens": 8}) == DEFAULT_REPLY_BYTES
    assert chat_reply_limit({"max_tokens": 100_000}) > chat_reply_limit({"max_completion_tokens": 50_000}) > (
        DEFAULT_REPLY_BYTES)


async def test_a_large_answer_is_checked_off_the_loop_with_the_same_verdict() -> None:
    ids = [i % VOCAB for i in range(20_000)]  # past CHECK_IN_THREAD_TOKENS
    reply = {"text": "x", "output_ids": ids, "meta_info": {"finish_reason": {"type": "length", "length": 20_000},
                                                           "output_token_logprobs": [[-0.5, i, None] for i in ids]}}
    payload = {"input_ids": [1], "return_logprob": True}
    (typed,) = await check_generate_body_async(reply, URL, payload, VOCAB)
    assert typed.output_ids == tuple(ids)
    reply["meta_info"]["output_token_logprobs"][-1][0] = math.nan
    with pytest.raises(EngineReplyError, match=r"output_token_logprobs\[19999\] has logprob nan"):
        await check_generate_body_async(reply, URL, payload, VOCAB)
