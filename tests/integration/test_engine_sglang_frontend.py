"""SGLang's own frontend (the real `sglang` wheel) against `rayless engine`, and SGLang's own sampling-parameter
rules beside ours (issue 11: our engine tracks SGLang 0.5.x's SamplingParams).

The frontend runs in a child process (`tests.support.sglang_frontend_driver`) with the wheel's site directory
on PYTHONPATH (`tests.support.sglang_site`); it never raises on HTTP errors but keeps them in `state.error()`,
so every program's error is asserted None and its variables are compared with what the engine answers directly.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.engine_proc import start_engine
from tests.support.sglang_site import REPO_ROOT, child_env, frontend_site
from workers.engine.sampling_params import RequestError, parse_sampling_params

# The body SGLang's frontend sends for every `gen` (0.5.23), stop_regex included.
FRONTEND_BODY = {
    "skip_special_tokens": True,
    "spaces_between_special_tokens": True,
    "max_new_tokens": 8,
    "min_new_tokens": 0,
    "n": 1,
    "stop": [],
    "stop_token_ids": [],
    "stop_regex": [],
    "temperature": 0,
    "top_p": 1.0,
    "top_k": -1,
    "min_p": 0.0,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "ignore_eos": False,
    "regex": None,
    "json_schema": None,
}
ACCEPTED = [
    {},
    FRONTEND_BODY,
    {"temperature": 0.5, "top_p": 0.9, "top_k": 5, "min_p": 0.1},
    {"frequency_penalty": 1.5, "presence_penalty": -1.0, "repetition_penalty": 1.3},
    {"stop": "x", "stop_regex": [r"\d+", "a|b"]},
    {"stop_regex": "x" * 256},
    {"stop": [f"s{i}" for i in range(32)], "stop_regex": [f"r{i}" for i in range(32)]},
    {"logit_bias": {"5": 2.0, "7": -1.5}},
    {"sampling_seed": -(2**63)},
    {"sampling_seed": 2**63 - 1},
    {"beam_width": 1},
    {"watermark": None},
    {"watermark": {"enabled": False}},
    {"custom_params": {"a": 1, "b": [1, "x", None], "c": {"d": 2.5}}},
    {"stream_interval": 4},
    {"max_new_tokens": None},
    {"regex": "", "json_schema": None, "ebnf": None, "structural_tag": None},
    {"top_k": -1, "temperature": 0.0},
]
# Rejected by both; where the message is SGLang's verify() text, ours must be the same words.
REJECTED = [
    ({"top_k": 0}, True),
    ({"top_k": -2}, True),
    ({"top_p": 0.0}, True),
    ({"top_p": 1.5}, True),
    ({"min_p": 1.5}, True),
    ({"temperature": -1.0}, True),
    ({"frequency_penalty": 3.0}, True),
    ({"presence_penalty": -2.5}, True),
    ({"repetition_penalty": 0.0}, True),
    ({"repetition_penalty": 2.5}, True),
    ({"min_new_tokens": -1}, True),
    ({"max_new_tokens": -1}, True),
    ({"max_new_tokens": 4, "min_new_tokens": 5}, True),
    ({"logit_bias": {"100000": 1.0}}, True),
    ({"sampling_seed": 2**63}, False),
    ({"beam_width": 0}, True),
    ({"stop_regex": "x" * 257}, True),
    ({"stop_regex": ["a"] * 33}, True),
    ({"stop": ["a"] * 33}, True),
    ({"stop_regex": "(a"}, False),
    ({"json_schema": "{}", "regex": "a"}, True),
    ({"watermark": {"bogus": 1}}, True),
    ({"watermark": {"enabled": "yes"}}, True),
    ({"bogus_key": 1}, False),
]
# SGLang takes these; this engine refuses them, with a 400 naming the field (what it cannot honour or bounds).
DIVERGENT = [
    ({"regex": "[0-9]+"}, "regex"),
    ({"json_schema": "{}"}, "json_schema"),
    ({"ebnf": "root ::= 'a'"}, "ebnf"),
    ({"structural_tag": "{}"}, "structural_tag"),
    ({"beam_width": 2}, "beam_width"),
    ({"watermark": {"enabled": True}}, "watermark"),
    ({"n": 129}, "--max-n"),
    ({"stop_token_ids": [100000]}, "stop_token_ids"),
]


@pytest.fixture(scope="module")
def engine_url(tiny_model_dir: Path) -> Iterator[str]:
    with start_engine(tiny_model_dir) as url:
        yield url


def direct(url: str, body: dict[str, Any]) -> Any:
    response = httpx.post(url + "/generate", json=body, timeout=60.0)
    assert response.status_code == 200, response.text
    return response.json()


def ours(case: dict[str, Any], vocab_size: int) -> str | None:
    try:
        parse_sampling_params(case, vocab_size=vocab_size)
    except RequestError as exc:
        return str(exc)
    return None


def stop_pattern(free_text: str) -> str:
    """A regex (not a literal) matching the 2nd and 3rd characters of the greedy text, wherever they first occur."""
    return "(?:" + re.escape(free_text[1:3]) + ")"


def run_driver(url: str, vocab_size: int, pattern: str) -> dict[str, Any]:
    cases = ACCEPTED + [case for case, _ in REJECTED] + [case for case, _ in DIVERGENT]
    process = subprocess.run(
        [sys.executable, "-m", "tests.support.sglang_frontend_driver", url],
        input=json.dumps({"cases": cases, "vocab_size": vocab_size, "stop_regex": pattern}),
        capture_output=True,
        text=True,
        env=child_env(frontend_site()),
        cwd=REPO_ROOT,
        timeout=240,
    )
    assert process.returncode == 0, process.stderr[-3000:]
    return json.loads(process.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def driven(engine_url: str, tiny_model_dir: Path) -> dict[str, Any]:
    from transformers import AutoConfig

    free = direct(engine_url, {"text": "1 2 3=", "sampling_params": {"max_new_tokens": 12, "temperature": 0}})
    vocab = AutoConfig.from_pretrained(str(tiny_model_dir)).vocab_size
    return {**run_driver(engine_url, vocab, stop_pattern(free["text"])), "free": free["text"]}


def test_gen_stream_and_run_batch_match_the_engine(driven: dict[str, Any], engine_url: str) -> None:
    assert driven["sglang_version"].startswith("0.5.")
    expected = direct(engine_url, {"text": "Q: hi\nA:", "sampling_params": {"max_new_tokens": 8, "temperature": 0}})
    gen = driven["gen"]
    assert gen["error"] is None
    assert gen["vars"]["answer"] == expected["text"]
    assert gen["meta"]["answer"]["completion_tokens"] == expected["meta_info"]["completion_tokens"]
    stream = driven["stream"]
    assert stream["error"] is None
    assert "".join(stream["pieces"]) == stream["vars"]["answer"] == expected["text"]
    assert len(driven["run_batch"]) == 3
    for state, question in zip(driven["run_batch"], ["hi", "1 2", "ab"], strict=True):
        assert state["error"] is None
        alone = direct(
            engine_url, {"text": f"Q: {question}\nA:", "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
        )
        assert state["vars"]["answer"] == alone["text"]


def test_stop_regex_finishes_at_the_match_untrimmed(driven: dict[str, Any]) -> None:
    free = driven["free"]
    assert len(free) >= 3, free  # one token per character: 12 tokens of greedy text
    state = driven["stop_regex"]
    assert state["error"] is None
    pattern = stop_pattern(free)
    # SGLang: finish type stop, `matched` is the pattern itself, and since the pattern is no literal of the text,
    # the match is not cut: the text ends right after the first occurrence.
    assert state["meta"]["stopped"]["finish_reason"] == {"type": "stop", "matched": pattern}
    assert state["vars"]["stopped"] == free[: free.find(free[1:3]) + 2]


def test_select_and_logprobs(driven: dict[str, Any]) -> None:
    select = driven["select"]
    assert select["error"] is None
    assert select["vars"]["choice"] in ("yes", "no", "1 2")
    scored = driven["logprobs"]
    assert scored["error"] is None
    meta = scored["meta"]["scored"]
    assert len(meta["output_token_logprobs"]) == meta["completion_tokens"] >= 1
    assert meta["input_token_logprobs"][0][0] is None and len(meta["input_token_logprobs"]) == len("1 2 3=")
    assert all(len(entry) == 2 for entry in meta["output_top_logprobs"])
    assert all(isinstance(text, str) for _, _, text in meta["output_token_logprobs"])


def test_constrained_decoding_is_a_clear_error_in_the_frontend(driven: dict[str, Any]) -> None:
    state = driven["constrained"]
    assert state["error"] is not None
    assert "regex" in state["error"] and "not supported" in state["error"]
    assert state["vars"]["number"] is None


def test_sampling_params_rules_agree_with_sglang(driven: dict[str, Any], tiny_model_dir: Path) -> None:
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(str(tiny_model_dir)).vocab_size
    verdicts = driven["parity"]
    accepted, rest = verdicts[: len(ACCEPTED)], verdicts[len(ACCEPTED) :]
    rejected, divergent = rest[: len(REJECTED)], rest[len(REJECTED) :]
    for case, theirs in zip(ACCEPTED, accepted, strict=True):
        assert theirs is None, (case, theirs)
        assert ours(case, vocab) is None, case
    for (case, same_words), theirs in zip(REJECTED, rejected, strict=True):
        mine = ours(case, vocab)
        assert theirs is not None and mine is not None, (case, theirs, mine)
        if same_words:
            assert theirs.split(": ", 1)[1] == mine, case
    for (case, field), theirs in zip(DIVERGENT, divergent, strict=True):
        assert theirs is None, (case, theirs)
        mine = ours(case, vocab)
        assert mine is not None and field in mine, (case, mine)
