"""When a sequence finishes, and what its text is: SGLang 0.5.23's finish checks and stop trimming.

Owns `finish_check` (called after every accepted token) and `trim_text` (the detokenizer's trim).

SGLang's order after each token: stop strings, then stop regexes (both on text), then stop tokens / EOS
(skipped with `ignore_eos`), then the length cap. So a stop string that appears in the very token that also
reaches `max_new_tokens` finishes as `stop`, not `length`.
- A stop string matches anywhere in the decoded output (special tokens included in the decoding, as SGLang's
  tail check decodes them); `matched` is the string.
- A stop regex is searched (`re.search` semantics) in the decoded tail of the last
  `stop_regex_max_len + 1` tokens (the whole output when the pattern's length has no bound); `matched` is the
  *pattern*. A pattern whose search runs past `REGEX_TIMEOUT_S` aborts that request (SGLang aborts a request
  whose pattern fails at decode time); nothing else is affected.
- Trimming (`trim_text`) looks for `matched` literally in the text, as SGLang's detokenizer does, so a regex
  match is cut only when the pattern is itself a literal that occurs in the text. A stop token is dropped from
  the text unless `no_stop_trim`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import regex as regex_module

from workers.boundary.json_input import JsonObject
from workers.engine.sampling_params import SamplingParams

REGEX_TIMEOUT_S = 0.05

Decode = Callable[[Sequence[int]], str]


def _text_stop(params: SamplingParams, output_ids: Sequence[int], decode: Decode) -> JsonObject | None:
    if params.stop:
        text = decode(output_ids)
        for stop in params.stop:
            if stop in text:
                return {"type": "stop", "matched": stop}
    if params.stop_regex:
        tail_len = min(params.stop_regex_max_len + 1, len(output_ids))
        tail = decode(output_ids[len(output_ids) - tail_len :])
        for pattern in params.stop_regex:
            try:
                found = regex_module.search(pattern, tail, timeout=REGEX_TIMEOUT_S)
            except TimeoutError:
                return {
                    "type": "abort",
                    "message": f"stop_regex {pattern!r} took over {REGEX_TIMEOUT_S} s to search; request aborted",
                }
            if found:
                return {"type": "stop", "matched": pattern}
    return None


def finish_check(
    params: SamplingParams,
    output_ids: Sequence[int],
    *,
    eos_ids: frozenset[int],
    max_new_tokens: int,
    decode: Decode,
) -> JsonObject | None:
    """The finish reason after the last token of `output_ids` was accepted, or None to go on."""
    reason = _text_stop(params, output_ids, decode)
    if reason is not None:
        return reason
    token = output_ids[-1]
    if not params.ignore_eos and (token in params.stop_token_ids or token in eos_ids):
        return {"type": "stop", "matched": token}
    if len(output_ids) >= max_new_tokens:
        return {"type": "length", "length": max_new_tokens}
    return None


def trim_text(text: str, reason: JsonObject | None, no_stop_trim: bool) -> str:
    """Cut a matched stop string (or a literal regex) from `text`, as SGLang's detokenizer does."""
    matched = (reason or {}).get("matched")
    if not isinstance(matched, str):
        return text
    position = text.find(matched)
    if position == -1:
        return text
    return text[: position + len(matched)] if no_stop_trim else text[:position]
