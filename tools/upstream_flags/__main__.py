"""Regenerate coordinator/config/upstream_flags.tsv from upstream checkouts (or check that it is current).

    python -m tools.upstream_flags --slime DIR --miles DIR --megatron DIR --router FILE --sglang FILE \\
        [--since 2026-05-01] [--check]

DIR is a git directory (a clone's `.git`, or a bare mirror); FILE is sglang-router's `router_args.py` and
SGLang's `srt/server_args.py` (an installed wheel's). Flags are read statically (`tools.upstream_flags.extract`)
from every version of the flag-declaring files since `--since` up to each project's HEAD, so a flag added and
removed in that time stays listed. Each row keeps the disposition already in the file; a new flag gets one
from `default_disposition` (`review` where a person must decide: the repo's test fails until they do).
`--check` writes nothing and prints the unified diff (exit 1 when there is one).
"""

from __future__ import annotations

import argparse
import difflib
import sys
from pathlib import Path

from tools.upstream_flags import sources
from tools.upstream_flags.table import DATA_FILE, Row, default_disposition, read_rows, render


def _origins(table: dict[str, dict[str, str]], name: str, flags: dict[str, str]) -> None:
    for flag, kind in flags.items():
        table.setdefault(flag, {}).setdefault(name, kind)


def build(options: argparse.Namespace) -> tuple[dict[str, dict[str, str]], list[str]]:
    """flag → {origin: arity}, and the header lines naming what was read."""
    table: dict[str, dict[str, str]] = {}
    header = [f"read by tools/upstream_flags from every version since {options.since} of:"]
    for source, git_dir in ((sources.SLIME, options.slime), (sources.MILES, options.miles),
                            (sources.MEGATRON, options.megatron)):
        flags, revs = source.collect(Path(git_dir), "HEAD", options.since)
        head = sources.git(Path(git_dir), "log", "-1", "--format=%H %cs", "HEAD").strip()
        header.append(f"{source.name}: {head} ({len(revs)} revisions)")
        _origins(table, source.name, flags)
        if source.patched:
            _origins(table, "megatron", source.patched)
            header.append(f"  megatron: also the flags added by {source.name}'s docker/patch/*/megatron*.patch")
    skipped = sources.slime_sglang_skipped(Path(options.slime), "HEAD")
    router_version = _version(Path(options.router).parent / "version.py")
    _origins(table, "sglang-router", sources.router_flags(Path(options.router)))
    header.append(f"sglang-router: {router_version} router_args.py, under slime's --router- prefix")
    _origins(table, "sglang", sources.sglang_flags(Path(options.sglang), skipped))
    sglang_version = _dist_version(Path(options.sglang))
    header.append(f"sglang: {sglang_version} srt/server_args.py, under slime's --sglang- prefix")
    header.append("plus, kept by hand and by regeneration (notes saying 'retired' or naming miles' Megatron-LM "
                  "fork): the flags slime and miles removed before those commits (their whole histories of "
                  "arguments.py), which older launch scripts still pass, and those of miles' Megatron-LM fork its "
                  "launchers pass")
    return table, header


def _version(path: Path) -> str:
    for line in path.read_text(encoding="utf-8").splitlines() if path.is_file() else ():
        if line.startswith("__version__"):
            return line.split("=", 1)[1].strip().strip("'\"")
    return "unknown version"


def _dist_version(server_args: Path) -> str:
    site = server_args.parents[2]
    for info in sorted(site.glob("sglang-*.dist-info")):
        return info.name[len("sglang-"):-len(".dist-info")]
    return "unknown version"


#: what the note of a row this reader cannot find says, for the row to be kept: a flag slime or miles removed
#: before the revisions read, or one of miles' Megatron-LM fork (which is not read)
KEPT_BY_HAND = ("retired", "miles' Megatron-LM fork")


def merge(table: dict[str, dict[str, str]], existing: dict[str, Row]) -> list[Row]:
    """The rows of the flags read, each keeping its decided disposition; plus the existing rows `KEPT_BY_HAND`,
    flags real launch scripts pass that must not come back as unknown."""
    retired = [row for flag, row in existing.items()
               if flag not in table and any(mark in row.note for mark in KEPT_BY_HAND)]
    rows = []
    for flag in sorted(table):
        origins = table[flag]
        arity = next(iter(origins.values()))
        for preferred in ("slime", "miles", "megatron", "sglang-router", "sglang"):
            if preferred in origins:
                arity = origins[preferred]
                break
        kept = existing.get(flag)
        disposition, note = (kept.disposition, kept.note) if kept else default_disposition(flag, origins)
        rows.append(Row(flag, tuple(o for o in ("slime", "miles", "megatron", "sglang-router", "sglang")
                                    if o in origins), arity, disposition, note))
    return sorted(rows + retired, key=lambda row: row.flag)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.upstream_flags", description=__doc__.split("\n")[0])
    for name in ("slime", "miles", "megatron"):
        parser.add_argument(f"--{name}", required=True, metavar="GIT_DIR")
    parser.add_argument("--router", required=True, metavar="router_args.py")
    parser.add_argument("--sglang", required=True, metavar="server_args.py")
    parser.add_argument("--since", default="2026-05-01")
    parser.add_argument("--output", default=str(DATA_FILE))
    parser.add_argument("--check", action="store_true", help="print the diff, write nothing; exit 1 if any")
    options = parser.parse_args(argv)
    table, header = build(options)
    output = Path(options.output)
    old_text = output.read_text(encoding="utf-8") if output.is_file() else ""
    existing = {row.flag: row for row in read_rows(old_text)}
    new_text = render(header, merge(table, existing))
    diff = list(difflib.unified_diff(old_text.splitlines(keepends=True), new_text.splitlines(keepends=True),
                                     str(output), str(output) + " (regenerated)"))
    if options.check:
        sys.stdout.writelines(diff)
        print(f"{len(diff)} diff lines; {len(table)} flags")
        return 1 if diff else 0
    output.write_text(new_text, encoding="utf-8")
    print(f"wrote {output}: {len(table)} flags, {len(diff)} diff lines")
    return 0


if __name__ == "__main__":
    sys.exit(main())
