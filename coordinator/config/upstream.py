"""The flags of slime, miles, Megatron-LM, sglang-router and SGLang (as slime adds them), and what each means
here: `upstream_flags.tsv` beside this module, regenerated from upstream checkouts by `tools/upstream_flags`.

Owns the data file's format (`Row`, `read_rows`, `render`), its rows (`UPSTREAM`, read once) and the
dispositions:
- `implemented`: a flag of rayless (a field of a slice), or, for `--sglang-*`, passed to sglang.launch_server;
- `mapped`: a flag of rayless that does something else than upstream's, or an old name upstream renamed
  (`RENAMED`, read as its current name); the note is the notice line printed;
- `ignored`: accepted with its value and unused, because it has no meaning under FSDP2 (the note's first word
  is a category of `megatron.CATEGORIES`, said in the grouped notice);
- `refused`: accepted by the parser only to stop the run with the note, which names the feature and why;
- `review`: a new upstream flag nobody has decided yet (the repo's test fails until someone does).

Invariants: one row per flag; flipping a disposition is a change of that one line; reading the file is the
only I/O, and it happens once per process.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

DATA_FILE = Path(__file__).with_name("upstream_flags.tsv")
DISPOSITIONS = ("implemented", "mapped", "ignored", "refused", "review")
ORIGIN_NAMES = {"slime": "slime", "miles": "miles", "megatron": "Megatron-LM", "sglang-router": "sglang-router",
                "sglang": "SGLang"}
_COLUMNS = "flag\torigins\tarity\tdisposition\tnote"


@dataclass(frozen=True)
class Row:
    flag: str
    origins: tuple[str, ...]
    #: what follows the flag: switch | value | values | optional | N
    arity: str
    disposition: str
    note: str = ""

    @property
    def category(self) -> str:
        """An ignored flag's category (the note's first word)."""
        return self.note.split(":", 1)[0].split()[0] if self.note else "other"

    def origin_text(self) -> str:
        return ", ".join(ORIGIN_NAMES.get(origin, origin) for origin in self.origins)


def read_rows(text: str) -> list[Row]:
    rows = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip() or line.startswith("#") or line == _COLUMNS:
            continue
        parts = line.split("\t")
        if len(parts) < 4 or parts[3] not in DISPOSITIONS:
            raise ValueError(f"{DATA_FILE.name}:{number}: expected {_COLUMNS!r} with a disposition of "
                             f"{', '.join(DISPOSITIONS)}, got {line!r}")
        rows.append(Row(parts[0], tuple(parts[1].split(",")), parts[2], parts[3], parts[4] if len(parts) > 4
                        else ""))
    return rows


def render(header: list[str], rows: list[Row]) -> str:
    lines = [f"# {line}" for line in header]
    lines.append("# dispositions: implemented | mapped (note: the notice) | ignored (note: category[: detail]) | "
                 "refused (note: feature: why) | review")
    lines.append(_COLUMNS)
    lines += [f"{r.flag}\t{','.join(r.origins)}\t{r.arity}\t{r.disposition}\t{r.note}".rstrip("\t") for r in rows]
    return "\n".join(lines) + "\n"


#: flags slime and miles renamed before the commits the table reads: the old name is read as the new one, and the
#: notice says so (older launch scripts still pass the old names; each has a `mapped` row saying "retired")
RENAMED: dict[str, str] = {
    "--sampling-batch-size": "--over-sampling-batch-size",  # slime, 2025-06
    "--rollout-num-gpus-per-node": "--num-gpus-per-node",  # slime #316, 2025-09
    "--critic-config-path": "--megatron-config-path",  # slime #1866, 2026-04
}


def rename_retired_flags(argv: list[str]) -> tuple[list[str], tuple[tuple[str, str], ...]]:
    """`argv` with each renamed flag (`RENAMED`, alone or as `--old=value`) under its current name; the renames
    made, for the notice."""
    renamed: list[tuple[str, str]] = []
    out = []
    for token in argv:
        name, equals, value = token.partition("=")
        new = RENAMED.get(name) if name.startswith("--") else None
        if new is not None:
            if (name, new) not in renamed:
                renamed.append((name, new))
            token = new + equals + value
        out.append(token)
    return out, tuple(renamed)


@functools.cache
def upstream_rows() -> dict[str, Row]:
    """flag → its row."""
    return {row.flag: row for row in read_rows(DATA_FILE.read_text(encoding="utf-8"))}


@functools.cache
def checked_versions() -> str:
    """What the table was read from, for the unknown-flag message (`slime 624b824 (2026-08-21), ...`)."""
    versions = []
    for line in DATA_FILE.read_text(encoding="utf-8").splitlines():
        if not line.startswith("# "):
            break
        name, _, rest = line[2:].partition(": ")
        words = rest.split()
        if name in ("slime", "miles", "megatron") and len(words) >= 2:
            versions.append(f"{ORIGIN_NAMES[name]} {words[0][:7]} ({words[1]})")
        elif name in ("sglang-router", "sglang") and words:
            versions.append(f"{ORIGIN_NAMES[name]} {words[0]}")
    return ", ".join(versions)


