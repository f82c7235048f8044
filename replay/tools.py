"""`rayless dump show | verify | convert`: inspect, check and import rollout dumps from the command line.

Owns the dump subcommands; the lead's CLI calls `main(argv_after_dump)`. Invariants: `verify` checks every
file it is given, says what is wrong with each, and exits 1 when any is corrupt, 0 otherwise; `show` streams
the file, so memory stays at one sample whatever the dump size; `convert` never executes the source file's
content. Everything read from a file is printed as text: the consoles interpret no rich markup and no
emoji codes, so a header string such as "[/]" prints as itself instead of breaking the output.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from replay.format import DumpError
from replay.meaning import MeaningCheck
from replay.reader import iter_samples, read_header
from replay.sample import Sample


class _Stats:
    """Running count / mean / std / min / max (Welford), so `show` never holds the samples."""

    def __init__(self) -> None:
        self.n = 0
        self.mean = 0.0
        self.m2 = 0.0
        self.min = math.inf
        self.max = -math.inf

    def add(self, x: float) -> None:
        self.n += 1
        delta = x - self.mean
        self.mean += delta / self.n
        self.m2 += delta * (x - self.mean)
        self.min = min(self.min, x)
        self.max = max(self.max, x)

    def row(self, name: str) -> list[str]:
        if self.n == 0:
            return [name, "0", "-", "-", "-", "-"]
        std = math.sqrt(self.m2 / self.n)
        return [name, str(self.n), f"{self.mean:.4g}", f"{std:.4g}", f"{self.min:.4g}", f"{self.max:.4g}"]


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive integer")
    return value


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rayless dump", description="Inspect, check and import rollout dumps."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    show = sub.add_parser("show", help="header, counts, reward and length statistics of one dump")
    show.add_argument("file", type=Path)
    show.add_argument("--tokenizer", type=Path, default=None, help="tokenizer dir: decode the first samples")
    show.add_argument("--first", type=int, default=3, help="how many samples to print (default 3)")
    verify = sub.add_parser("verify", help="check dumps end to end, form and meaning; exit 1 if any is not sound")
    verify.add_argument("files", type=Path, nargs="+")
    vocabulary = verify.add_mutually_exclusive_group()
    vocabulary.add_argument("--tokenizer", type=Path, default=None,
                            help="model or tokenizer dir: token ids must be in its vocabulary")
    vocabulary.add_argument("--vocab-size", type=_positive, default=None, help="token ids must be below this")
    convert = sub.add_parser("convert", help="import a slime/miles .pt dump into the rayless format")
    convert.add_argument("src", type=Path)
    convert.add_argument("dst", type=Path)
    convert.add_argument("--n-samples-per-prompt", type=int, default=None)
    convert.add_argument("--rollout-id", type=int, default=None, help="override the id stored in SRC")
    convert.add_argument(
        "--allow-missing-logprobs",
        action="store_true",
        help="fill missing rollout logprobs with zeros (flagged in each sample's metadata)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    console = _console()
    if args.command == "show":
        return _show(console, args.file, args.tokenizer, args.first)
    if args.command == "verify":
        vocab_size = _vocab_size(console, args.tokenizer) if args.tokenizer is not None else args.vocab_size
        if args.tokenizer is not None and vocab_size is None:
            return 1
        return _verify(console, args.files, vocab_size)
    return _convert(console, args)


class _Console(Console):
    def on_broken_pipe(self) -> None:
        """The reader left (`rayless dump show D | head`): raised on, so the command line ends the command the
        way it ends every other one whose reader left (exit 0, `coordinator.cli`), not rich's exit 1."""
        raise BrokenPipeError


def _console(*, stderr: bool = False) -> Console:
    # markup and emoji off: dump contents (and file names) are data, never formatting instructions
    return _Console(stderr=stderr, soft_wrap=True, highlight=False, markup=False, emoji=False)


def _error(console: Console, message: str) -> None:
    _console(stderr=True).print(Text.assemble(("error:", "bold red"), " ", message))


def _show(console: Console, path: Path, tokenizer_dir: Path | None, first: int) -> int:
    try:
        header = read_header(path)
    except DumpError as exc:
        _error(console, str(exc))
        return 1
    tokenizer = _load_tokenizer(console, tokenizer_dir) if tokenizer_dir is not None else None
    if tokenizer_dir is not None and tokenizer is None:
        return 1

    info = Table(title=f"dump {path}", show_header=False)
    for key in ("format_version", "rollout_id", "kind", "created_at_iso", "writer", "sample_count"):
        info.add_row(key, str(header.raw.get(key)))
    for key, value in header.config.items():
        # a mapping (the rollout's metrics, the training flags a replay takes) one row per entry, not one repr
        entries = value.items() if isinstance(value, dict) else [(None, value)]
        for sub, item in entries:
            info.add_row(f"config.{key}" + ("" if sub is None else f".{sub}"),
                         item if isinstance(item, str) else repr(item))
    console.print(info)

    statuses: Counter[str] = Counter()
    groups: Counter[int] = Counter()
    rewards: dict[str, _Stats] = {}
    lengths, prompt_lengths, advantages = _Stats(), _Stats(), _Stats()
    shown: list[Sample] = []
    try:
        for sample in iter_samples(path):
            statuses[sample.status.value] += 1
            groups[sample.group_index] += 1
            lengths.add(sample.response_length)
            prompt_lengths.add(sample.prompt_length)
            advantages.add(sample.advantage)
            if isinstance(sample.reward, dict):
                for key, value in sample.reward.items():
                    rewards.setdefault(f"reward.{key}", _Stats()).add(float(value))
            elif sample.reward is not None:
                rewards.setdefault("reward", _Stats()).add(float(sample.reward))
            if len(shown) < first:
                shown.append(sample)
    except DumpError as exc:
        _error(console, str(exc))
        return 1

    sizes = Counter(groups.values())
    console.print(
        f"groups: {len(groups)}  samples: {sum(groups.values())}  group sizes: "
        + ", ".join(f"{size}×{count}" for size, count in sorted(sizes.items()))
    )
    console.print("status: " + ", ".join(f"{name} {count}" for name, count in sorted(statuses.items())))
    stats = Table(title="statistics")
    for column in ("field", "n", "mean", "std", "min", "max"):
        stats.add_column(column, justify="right" if column != "field" else "left")
    for name, stat in sorted(rewards.items()):
        stats.add_row(*stat.row(name))
    if not rewards:
        stats.add_row("reward", "0", "-", "-", "-", "-")
    stats.add_row(*lengths.row("response_length"))
    stats.add_row(*prompt_lengths.row("prompt_length"))
    stats.add_row(*advantages.row("advantage"))
    console.print(stats)

    for sample in shown:
        console.rule(f"sample {sample.group_index}/{sample.sample_index} · {sample.status.value}")
        console.print(f"reward: {sample.reward!r}  advantage: {sample.advantage:.4g}  "
                      f"weight_versions: {sample.weight_versions}  label: {sample.label!r}")  # fmt: skip
        console.print(f"prompt ({sample.prompt_length} tokens): {_clip(sample.prompt)}")
        console.print(f"response ({sample.response_length} tokens): {_clip(sample.response)}")
        if sample.multimodal_train_inputs:
            grid = sample.multimodal_train_inputs["image_grid_thw"]
            console.print(f"images: {len(grid)} (patch grids t×h×w: "
                          + ", ".join("×".join(str(v) for v in row) for row in grid) + ")")
        if sample.is_multi_turn:
            spans = sum(1 for i, m in enumerate(sample.loss_mask) if m == 0 and (i == 0 or sample.loss_mask[i - 1]))
            console.print(f"multi-turn: {sample.effective_response_length} of {sample.response_length} response "
                          f"tokens trained; {spans} tool span(s) with loss mask 0")
        if tokenizer is not None:
            decoded = tokenizer.decode(sample.response_tokens)
            console.print(f"decoded response: {_clip(decoded)}")
    return 0


def _clip(value: object, limit: int = 400) -> str:
    """Text on one line, clipped; a non-text prompt (chat messages, a task index) shown as its repr."""
    text = (value if isinstance(value, str) else repr(value)).replace("\n", "⏎")
    return text if len(text) <= limit else text[:limit] + f"… (+{len(text) - limit} chars)"


def _load_tokenizer(console: Console, tokenizer_dir: Path) -> Any:
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(tokenizer_dir))
    except (OSError, ValueError) as exc:
        _error(console, f"cannot load a tokenizer from {tokenizer_dir}: {exc}")
        return None


def _verify(console: Console, files: list[Path], vocab_size: int | None = None) -> int:
    corrupt = invalid = 0
    for path in files:
        meaning = MeaningCheck(vocab_size)
        try:
            header = read_header(path)
            count = 0
            for sample in iter_samples(path):
                meaning.add(sample)
                count += 1
        except DumpError as exc:
            corrupt += 1
            console.print(f"CORRUPT {exc}")
            continue
        problem = meaning.summary()
        if problem is not None:
            invalid += 1
            console.print(f"INVALID {path}: {problem}")
            continue
        console.print(f"ok {path} ({header.kind} {header.rollout_id}, {count} samples)")
    if corrupt and invalid:
        console.print(f"{corrupt} corrupt and {invalid} invalid of {len(files)} file(s)")
    elif corrupt or invalid:
        console.print(f"{corrupt or invalid} of {len(files)} file(s) {'corrupt' if corrupt else 'invalid'}")
    return 1 if corrupt or invalid else 0


def _vocab_size(console: Console, directory: Path) -> int | None:
    """The larger of the tokenizer's length and config.json's `vocab_size` (models pad their embedding)."""
    tokenizer = _load_tokenizer(console, directory)
    if tokenizer is None:
        return None
    size = len(tokenizer)
    config = directory / "config.json"
    if config.is_file():
        from workers.boundary.errors import BoundaryError
        from workers.boundary.json_input import decode_json

        try:
            declared = decode_json(config.read_bytes(), str(config))
        except (BoundaryError, OSError):
            declared = None
        if isinstance(declared, dict) and type(declared.get("vocab_size")) is int:
            size = max(size, declared["vocab_size"])
    return size


def _convert(console: Console, args: argparse.Namespace) -> int:
    from replay.torch_import import convert_torch_dump

    try:
        out = convert_torch_dump(
            args.src,
            args.dst,
            n_samples_per_prompt=args.n_samples_per_prompt,
            allow_missing_logprobs=args.allow_missing_logprobs,
            rollout_id=args.rollout_id,
        )
        header = read_header(out)
    except DumpError as exc:
        _error(console, str(exc))
        return 1
    console.print(f"wrote {out} (rollout {header.rollout_id}, {header.sample_count} samples)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
