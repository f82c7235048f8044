"""The engine's sampling parameters, finish checks and sampler, without a server (issues 11 and 15).

SGLang-parity of the validation rules is checked against SGLang's own code in
`tests/integration/test_engine_sglang_frontend.py`; here: what the parsed values are, the stop semantics, and
that the sampler's adjustments do what SGLang's do while logprobs stay those of the raw logits.
"""

from __future__ import annotations

import math

import pytest
import torch

from workers.engine.sampling import RowSampling, sample_rows
from workers.engine.sampling_params import (
    TOP_K_ALL,
    UNBOUNDED,
    RequestError,
    SamplingParams,
    parse_sampling_params,
    regex_max_chars,
)
from workers.engine.stops import finish_check, trim_text

VOCAB = 16


def parse(**raw: object) -> SamplingParams:
    return parse_sampling_params(raw, vocab_size=VOCAB)


def test_defaults_and_sglang_normalisation() -> None:
    assert parse() == SamplingParams()
    assert parse(temperature=1e-7).temperature == 0.0  # SGLang: below 1e-6 is greedy
    assert parse(top_k=2**62).top_k == TOP_K_ALL  # in range for the sampler whatever the client sent
    assert parse(max_new_tokens=None).max_new_tokens is None  # up to the context length
    assert parse(stop=["", "x"]).stop == ("x",)
    assert parse(logit_bias={"3": 1.5, "1": -2}).logit_bias == ((1, -2.0), (3, 1.5))
    assert parse(regex="", watermark={"enabled": False}, beam_width=1, stop_strs=["ignored"]) == SamplingParams()


@pytest.mark.parametrize(
    ("raw", "needle"),
    [
        ({"top_k": 2**64}, "top_k must be in [-2**63"),
        ({"sampling_seed": -(2**63) - 1}, "sampling_seed"),
        ({"n": 129}, "--max-n"),
        ({"temperature": float("nan")}, "finite"),
        ({"temperature": 10**400}, "out of range"),
        ({"temperature": [[[[[[[[1]]]]]]]]}, "temperature must be a number"),
        ({"stop_regex": "a" * 300}, "256-byte limit"),
        ({"stop_regex": "(?P<x"}, "invalid stop_regex"),
        ({"custom_params": {"a": [[1]]}}, "custom_params"),
        ({"logit_bias": {"x": 1}}, "not a token id"),
        ({"logit_bias": {"1": float("inf")}}, "finite"),
        ({"stop_token_ids": [VOCAB]}, "out of the vocabulary"),
        ({"stream_interval": 0}, "stream_interval"),
        ({"regex": "a+"}, "regex: constrained decoding is not supported"),
    ],
)
def test_rejections_name_the_field(raw: dict, needle: str) -> None:
    with pytest.raises(RequestError, match=None) as caught:
        parse_sampling_params(raw, vocab_size=VOCAB)
    assert needle in str(caught.value)
    assert len(str(caught.value)) < 400  # the client's value is shown bounded, never echoed whole


def test_unknown_keys_are_named_bounded() -> None:
    with pytest.raises(RequestError) as caught:
        parse_sampling_params({f"k{i}" * 50: 1 for i in range(20)}, vocab_size=VOCAB)
    assert str(caught.value).startswith("unknown sampling_params keys: ") and len(str(caught.value)) < 700


def test_regex_max_chars_bounds_the_match() -> None:
    assert regex_max_chars("abc") == 3
    assert regex_max_chars("a|bcd") == 3
    assert regex_max_chars(r"(ab){2}\b$") == 4
    assert regex_max_chars(r"[0-9]{1,5}") == 5
    assert regex_max_chars(r"\d+") == UNBOUNDED
    assert regex_max_chars(r"(?=a)b") == UNBOUNDED  # what SGLang does not bound either


def decode(ids: object) -> str:
    return "".join(chr(ord("a") + i) for i in ids)  # type: ignore[union-attr]


def check(params: SamplingParams, ids: list[int], max_new: int = 10) -> dict | None:
    return finish_check(params, ids, eos_ids=frozenset({9}), max_new_tokens=max_new, decode=decode)


def test_finish_order_is_sglangs() -> None:
    # A stop string in the same token that reaches the length cap, or that is EOS: stop string wins.
    assert check(parse(stop="bc"), [1, 2], max_new=2) == {"type": "stop", "matched": "bc"}
    assert check(parse(stop="j"), [9]) == {"type": "stop", "matched": "j"}
    assert check(parse(), [1, 9]) == {"type": "stop", "matched": 9}
    assert check(parse(ignore_eos=True), [1, 9]) is None
    assert check(parse(), [1, 2], max_new=2) == {"type": "length", "length": 2}
    # Stop strings are tried in the order given, anywhere in the text.
    assert check(parse(stop=["zz", "b", "a"]), [0, 1]) == {"type": "stop", "matched": "b"}


def test_stop_regex_searches_the_tail_window_and_reports_the_pattern() -> None:
    # "c." spans 2 characters: the window is the last 3 tokens, so an early "cx" is out of reach later on.
    params = parse(stop_regex=["c."])
    assert params.stop_regex_max_len == 2
    assert check(params, [2]) is None
    assert check(params, [2, 3]) == {"type": "stop", "matched": "c."}
    assert check(params, [0, 0, 0, 0], max_new=10) is None
    # An unbounded pattern searches the whole output.
    assert check(parse(stop_regex=r"a\w+e"), [0, 1, 2, 3, 4]) == {"type": "stop", "matched": r"a\w+e"}


def test_a_pathological_stop_regex_aborts_only_its_request() -> None:
    ids = [0] * 30 + [5]  # "aaaa...af"
    reason = check(parse(stop_regex=r"(a|a)+$"), ids, max_new=100)
    assert reason is not None and reason["type"] == "abort" and "stop_regex" in reason["message"]


def test_trim_is_a_literal_find_of_matched() -> None:
    stop = {"type": "stop", "matched": "cd"}
    assert trim_text("abcdef", stop, no_stop_trim=False) == "ab"
    assert trim_text("abcdef", stop, no_stop_trim=True) == "abcd"
    regex = {"type": "stop", "matched": "c."}
    assert trim_text("abcdef", regex, no_stop_trim=False) == "abcdef"  # a regex is no literal: not cut
    assert trim_text("abc", {"type": "stop", "matched": 3}, no_stop_trim=False) == "abc"


def row(**kw: object) -> RowSampling:
    base: dict = {"temperature": 0.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "generator": torch.Generator()}
    return RowSampling(**{**base, **kw})


def test_logit_bias_and_ban_steer_the_draw_but_not_the_logprob() -> None:
    logits = torch.linspace(0.0, 3.0, VOCAB).unsqueeze(0)
    raw = torch.log_softmax(logits, dim=-1)[0]
    (biased,) = sample_rows(logits, [row(logit_bias=((2, 100.0),))])
    assert biased.token == 2 and biased.logprob == pytest.approx(raw[2].item())
    (banned,) = sample_rows(logits, [row(logit_bias=((2, 100.0),), banned_ids=(2, VOCAB - 1))])
    assert banned.token == VOCAB - 2  # the ban wins over the bias; the next best is drawn


def test_penalties_follow_sglang() -> None:
    logits = torch.tensor([[2.0, 1.9, -1.0, -1.1]])
    # Repetition: a seen positive logit is divided, a seen negative one multiplied.
    (first,) = sample_rows(logits, [row(repetition_penalty=1.2, output_ids=[0])])
    assert first.token == 1  # 2.0 / 1.2 < 1.9
    (neg,) = sample_rows(torch.tensor([[-1.0, -1.1]]), [row(repetition_penalty=1.2, output_ids=[0])])
    assert neg.token == 1  # -1.0 * 1.2 < -1.1
    # Frequency counts occurrences; presence only whether a token was seen.
    (freq,) = sample_rows(logits, [row(frequency_penalty=0.05, output_ids=[0, 0, 0])])
    assert freq.token == 1  # 2.0 - 0.15 < 1.9
    (pres,) = sample_rows(logits, [row(presence_penalty=0.05, output_ids=[0, 0, 0])])
    assert pres.token == 0  # 2.0 - 0.05 > 1.9
    assert first.logprob == pytest.approx(torch.log_softmax(logits, -1)[0, 1].item())


def test_huge_top_k_samples_like_no_top_k() -> None:
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(0))
    rows_a = [row(temperature=1.0, top_k=TOP_K_ALL, top_p=0.999, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    rows_b = [row(temperature=1.0, top_k=-1, top_p=0.999, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    assert [r.token for r in sample_rows(logits, rows_a)] == [r.token for r in sample_rows(logits, rows_b)]
    assert all(math.isfinite(r.logprob) for r in sample_rows(logits, rows_a))
