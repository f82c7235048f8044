"""`rayless reward score`: a built-in reward type run over a JSONL file, to check a grader on one's own data.

    rayless reward score --rm-type T [--input-key K] [--label-key K] [--metadata-key K] [--tokens-key K]
                         [--reward-key K] [--out F] [--compare T2] FILE.jsonl

Owns reading the rows, scoring each with `reward_rules.apply_rule` (the rule a run uses) and reporting.
Without `--compare`: one JSON line per row, `{"index": i, "reward": r}` (or `{"index": i, "error": "..."}`), to
stdout or `--out`; a summary line on stderr. With `--compare T2`: stdout lists the rows where T and T2 differ
(and `--out`, if given, gets both rewards of every row). `--rm-type` decides for every row: a row's own
`metadata.rm_type` is not used, so two graders are compared on the same rows.

Progress goes to stderr while the rows are scored: the rows done and the rate, once a second on a terminal
(overwritten in place) and every `LOG_EVERY_S` seconds otherwise, then the summary with the whole run's rate.

Invariants: exit 0 when every row was scored; 1 when some row could not be (its line says why); 2 on bad flags
or a missing file (before anything is scored) or a file that cannot be read. The file is read line by line
(memory: one row at a time, plus, with `--compare`, the differing rows' short excerpts); the time per row does
not grow with the rows before it, so a file's time is linear in its rows.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from coordinator.rewards.rules import RewardError, RuleResult, apply_rule
from replay.sample import Sample, SampleError, SampleStatus, label_value
from workers.boundary.errors import BoundaryError
from workers.boundary.json_input import JsonLimits, decode_json

EXCERPT_CHARS = 60
LOG_EVERY_S = 10.0  # progress lines when stderr is not a terminal (a log file, CI)
LINE_LIMITS = JsonLimits(max_bytes=16 << 20, max_depth=64)  # one row: a response and its label


class ScoreInputError(Exception):
    """A row the flags cannot read (not JSON, not an object, a field of the wrong type)."""


@dataclass(frozen=True)
class Keys:
    response: str
    label: str
    metadata: str
    tokens: str


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rayless reward score",
                                     description="Score the responses of a JSONL file with a built-in reward type.")
    parser.add_argument("file", metavar="FILE.jsonl", help="one JSON object per line")
    parser.add_argument("--rm-type", required=True, help="the built-in reward type (as `rayless train --rm-type`)")
    parser.add_argument("--input-key", default="response", help="the field holding the response text (response)")
    parser.add_argument("--label-key", default="label", help="the field holding the label (label)")
    parser.add_argument("--metadata-key", default="metadata", help="the field holding the metadata (metadata)")
    parser.add_argument("--tokens-key", default="tokens", help="the field holding token ids, if any (tokens)")
    parser.add_argument("--reward-key", default=None, help="the entry of a dict reward that --compare compares")
    parser.add_argument("--compare", metavar="T2", default=None, help="a second reward type: print where they differ")
    parser.add_argument("--out", default=None, help="write the rewards (JSONL) here instead of stdout")
    return parser


def _rows(path: Path) -> Iterator[tuple[int, bytes]]:
    with path.open("rb") as handle:
        for number, line in enumerate(handle, start=1):
            if line.strip():
                yield number, line


class Progress:
    """Rows done and their rate on `stream`: in place once a second on a terminal, a line every `LOG_EVERY_S`
    seconds otherwise."""

    def __init__(self, stream: IO[str], label: str) -> None:
        self.stream = stream
        self.label = label
        self.tty = bool(getattr(stream, "isatty", lambda: False)())
        self.every = 1.0 if self.tty else LOG_EVERY_S
        self.started = self.last = time.monotonic()

    def rate(self, rows: int) -> float:
        return rows / max(time.monotonic() - self.started, 1e-9)

    def tick(self, rows: int) -> None:
        """Called every few rows; writes when its interval passed."""
        now = time.monotonic()
        if now - self.last < self.every:
            return
        self.last = now
        text = f"rayless reward score: {rows:,} rows scored with {self.label}, {self.rate(rows):,.0f} rows/s"
        self.stream.write(f"\r{text}" if self.tty else f"{text}\n")
        self.stream.flush()

    def done(self, summary: str, rows: int) -> None:
        elapsed = time.monotonic() - self.started
        end = "\r\033[K" if self.tty else ""
        self.stream.write(f"{end}rayless reward score: {summary} in {elapsed:.1f} s ({self.rate(rows):,.0f} rows/s)\n")
        self.stream.flush()


def _sample(line: bytes, number: int, keys: Keys, needs_label: bool) -> Sample:
    try:  # through the boundary layer: a line nested 100k deep is one row's error, not a RecursionError
        row = decode_json(line, f"line {number}", LINE_LIMITS)
    except BoundaryError as error:
        raise ScoreInputError(f"line {number} is not JSON within bounds ({error.reason})") from None
    if not isinstance(row, dict):
        raise ScoreInputError(f"line {number} is a JSON {type(row).__name__}, not an object")
    response = row.get(keys.response)
    if not isinstance(response, str):
        raise ScoreInputError(f"line {number} has no text field {keys.response!r} (--input-key)")
    try:  # the label as a run reads it (`label_value`: its JSON type kept), so both grade alike
        label = label_value(row.get(keys.label), where=f"line {number}", key=keys.label)
    except SampleError as error:
        raise ScoreInputError(str(error)) from None
    if needs_label and label is None:
        raise ScoreInputError(f"line {number} has no {keys.label!r} (--label-key): this reward type needs a label")
    metadata = row.get(keys.metadata) or {}
    if not isinstance(metadata, dict):
        raise ScoreInputError(f"line {number}: {keys.metadata!r} (--metadata-key) is not an object")
    tokens = row.get(keys.tokens) or []
    if not (isinstance(tokens, list) and all(isinstance(token, int) for token in tokens)):
        raise ScoreInputError(f"line {number}: {keys.tokens!r} (--tokens-key) is not a list of token ids")
    return Sample(group_index=0, sample_index=number - 1, prompt="", tokens=tokens, response_length=0,
                  loss_mask=[], rollout_log_probs=[], status=SampleStatus.COMPLETED, label=label,
                  response=response, metadata=metadata)


def _score(rm_type: str, sample: Sample) -> tuple[RuleResult | None, str | None]:
    try:
        return apply_rule(rm_type, sample), None
    except RewardError as error:
        return None, str(error)


def _comparable(reward: RuleResult | None, reward_key: str | None) -> RuleResult | float | None:
    if isinstance(reward, dict) and reward_key is not None:
        return reward.get(reward_key)
    return reward


def _excerpt(text: object) -> str:
    shown = json.dumps(text, ensure_ascii=False)
    return shown if len(shown) <= EXCERPT_CHARS else shown[: EXCERPT_CHARS - 1] + "…"


def _check_types(options: argparse.Namespace) -> tuple[bool, str | None]:
    """(whether a label is needed, an error to exit 2 with)."""
    from coordinator.rewards.rules import REMOTE_RM, RewardError, base_rule, require_libraries

    needs_label = False
    for flag, rm_type in (("--rm-type", options.rm_type), ("--compare", options.compare)):
        if rm_type is None:
            continue
        try:
            rule, _ = base_rule(rm_type)
            require_libraries(rm_type)
        except RewardError as error:
            return False, f"{flag}: {error}"
        if rule.name == REMOTE_RM:
            return False, f"{flag} remote_rm is scored by a running service; reward score runs built-in types only"
        needs_label = needs_label or rule.needs_label
    return needs_label, None


def _rows_text(count: int) -> str:
    return f"{count} row" if count == 1 else f"{count} rows"


def run(options: argparse.Namespace, out: IO[str] | None, report: IO[str]) -> int:
    """Score every row of `options.file`; reward lines to `out` (None: not written), differences to `report`."""
    keys = Keys(options.input_key, options.label_key, options.metadata_key, options.tokens_key)
    needs_label, error = _check_types(options)
    if error is not None:
        print(f"rayless reward score: error: {error}", file=sys.stderr)
        return 2
    rows = failed = differ = 0
    progress = Progress(sys.stderr, options.rm_type)
    for number, line in _rows(Path(options.file)):
        rows += 1
        if not rows & 1023:
            progress.tick(rows)
        try:
            sample = _sample(line, number, keys, needs_label)
        except ScoreInputError as problem:
            failed += 1
            if out is not None:
                out.write(json.dumps({"index": number - 1, "error": str(problem)}) + "\n")
            continue
        reward, problem_text = _score(options.rm_type, sample)
        record: dict[str, Any] = {"index": number - 1, "reward": reward} if problem_text is None else {
            "index": number - 1, "error": problem_text}
        row_failed = problem_text is not None
        if options.compare is not None:
            other, other_problem = _score(options.compare, sample)
            record["compare"] = other if other_problem is None else {"error": other_problem}
            row_failed = row_failed or other_problem is not None
            left, right = _comparable(record.get("reward"), options.reward_key), _comparable(other, options.reward_key)
            if problem_text is None and other_problem is None and left != right:
                differ += 1
                report.write(f"line {number}: {options.rm_type}={json.dumps(left)} {options.compare}="
                             f"{json.dumps(right)}  response={_excerpt(sample.response)} "
                             f"label={_excerpt(sample.label)}\n")
        failed += row_failed  # a row counts once, however many of its graders failed
        if out is not None:
            out.write(json.dumps(record, ensure_ascii=False) + "\n")
    graders = options.rm_type if options.compare is None else f"{options.rm_type} and {options.compare}"
    summary = f"{_rows_text(rows - failed)} scored with {graders}" + (f", {failed} could not be" if failed else "")
    if options.compare is not None:
        report.write(f"{options.rm_type} and {options.compare} differ on {differ} of {rows} rows\n")
    progress.done(summary, rows)
    return 1 if failed else 0


def main(argv: Sequence[str]) -> int:
    """`rayless reward score ...`: exit 0 all scored, 1 some row not, 2 bad flags or file."""
    args = list(argv)
    if not args or args[0] != "score":
        asked = args[:1] in (["-h"], ["--help"])
        print("usage: rayless reward score --rm-type T [...] FILE.jsonl  (rayless reward score --help)",
              file=sys.stdout if asked else sys.stderr)
        return 0 if asked else 2
    try:
        options = _parser().parse_args(args[1:])
    except SystemExit as exit_:
        return int(exit_.code or 0)
    path = Path(options.file)
    if not path.is_file():
        print(f"rayless reward score: error: {options.file}: no such file", file=sys.stderr)
        return 2
    try:
        if options.out is None:
            return run(options, None if options.compare else sys.stdout, sys.stdout)
        with open(options.out, "w", encoding="utf-8") as handle:
            return run(options, handle, sys.stdout)
    except BrokenPipeError:  # the reader stopped reading (`| head`): the command line ends it quietly (cli)
        raise
    except (OSError, UnicodeDecodeError) as error:
        print(f"rayless reward score: error: {options.file} or --out {options.out}: {error}", file=sys.stderr)
        return 2
