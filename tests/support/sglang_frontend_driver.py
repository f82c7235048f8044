"""Drives an SGLang-compatible server with SGLang's own frontend (the real wheel) and prints what it got.

Run as a script in a child process whose PYTHONPATH holds the SGLang frontend site (see
`tests.support.sglang_site`): `python -m tests.support.sglang_frontend_driver URL`. Prints one JSON object:
for each program, `error` (the frontend catches HTTP errors into `state.error()`, so a failure shows there,
never as an exception), its variables, and the meta_info of its generations. Also checks SGLang's own
`SamplingParams` validation on the cases read from stdin (JSON: `cases`, `vocab_size`, and the `stop_regex`
pattern one program uses) and reports each verdict, so the test compares SGLang's rules with the engine's on
the same inputs.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import sglang as sgl


@sgl.function
def answer(s: Any, question: str) -> None:
    s += "Q: " + question + "\nA:"
    s += sgl.gen("answer", max_tokens=8, temperature=0)


@sgl.function
def stop_at_pattern(s: Any, pattern: str) -> None:
    s += "1 2 3="
    s += sgl.gen("stopped", max_tokens=12, stop_regex=pattern, temperature=0)


@sgl.function
def choose(s: Any) -> None:
    s += "Q: 1 2 3=\nA:"
    s += sgl.select("choice", choices=["yes", "no", "1 2"])


@sgl.function
def with_logprobs(s: Any) -> None:
    s += "1 2 3="
    s += sgl.gen(
        "scored",
        max_tokens=3,
        temperature=0,
        return_logprob=True,
        logprob_start_len=0,
        top_logprobs_num=2,
        return_text_in_logprobs=True,
    )


@sgl.function
def constrained(s: Any) -> None:
    s += "Count:"
    s += sgl.gen("number", max_tokens=4, regex=r"[0-9]+")


def report(state: Any, names: list[str]) -> dict[str, Any]:
    error = state.error()
    return {
        "error": None if error is None else repr(error),
        "vars": {name: state.stream_executor.variables.get(name) for name in names},
        "meta": {name: state.get_meta_info(name) for name in names},
    }


def sglang_verdicts(cases: list[dict[str, Any]], vocab_size: int) -> list[str | None]:
    """None where SGLang's SamplingParams accepts the case, else its error message."""
    from sglang.srt.sampling.sampling_params import SamplingParams

    class CharTokenizer:  # normalize() counts a stop string's tokens; the tiny model has one per character
        def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
            return [0] * len(text)

    verdicts: list[str | None] = []
    for case in cases:
        try:
            params = SamplingParams(**case)
            params.verify(vocab_size)
            params.normalize(CharTokenizer())
            verdicts.append(None)
        except Exception as exc:  # SGLang raises ValueError, re.error, TypeError: all are verdicts
            verdicts.append(f"{type(exc).__name__}: {exc}")
    return verdicts


def main(url: str) -> None:
    config = json.loads(sys.stdin.read() or "{}")
    sgl.set_default_backend(sgl.RuntimeEndpoint(url))
    out: dict[str, Any] = {"sglang_version": sgl.__version__}
    out["gen"] = report(answer.run(question="hi"), ["answer"])
    streamed = answer.run(question="hi", stream=True)
    pieces = list(streamed.text_iter("answer"))
    streamed.sync()
    out["stream"] = {**report(streamed, ["answer"]), "pieces": pieces}
    out["stop_regex"] = report(stop_at_pattern.run(pattern=config["stop_regex"]), ["stopped"])
    out["select"] = report(choose.run(), ["choice"])
    out["logprobs"] = report(with_logprobs.run(), ["scored"])
    out["constrained"] = report(constrained.run(), ["number"])
    batch = answer.run_batch([{"question": "hi"}, {"question": "1 2"}, {"question": "ab"}], num_threads=3)
    out["run_batch"] = [report(state, ["answer"]) for state in batch]
    out["parity"] = sglang_verdicts(config["cases"], config["vocab_size"])
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1])
