"""The shell commands README.md and docs/*.md mark runnable, as the docs-as-tests test runs them.

Owns the marker convention (docs/testing.md, "The docs as tests"): an HTML comment `<!-- runnable -->` on the line
right before a fenced block whose info string is `bash` marks that block runnable; `<!-- runnable: gpu -->` and
`<!-- runnable: multi-node -->` mark one that needs a GPU or several nodes (skipped where there is none, by
name). Invariant: a marker not followed by a `bash` fence, or with another requirement, is an error naming the
page and line, never a block silently left out.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

MARKER = re.compile(r"^<!--\s*runnable(?::\s*(?P<needs>[a-z-]+))?\s*-->\s*$")
NEEDS = ("gpu", "multi-node")
FENCE = re.compile(r"^```(?P<info>\S*)\s*$")


class MarkerError(ValueError):
    """A runnable marker the convention does not allow (the page and line named)."""


@dataclass(frozen=True)
class Block:
    page: str  # relative to the repository root: README.md, docs/sft.md
    line: int  # the fence's line, 1-based
    script: str  # the block's text, run by bash as it stands
    needs: str | None = None  # "gpu" / "multi-node": skipped where the machine has none

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def pages(root: Path) -> list[Path]:
    """README.md, then docs/*.md in name order."""
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def runnable_blocks(text: str, page: str) -> list[Block]:
    """The blocks of one page that are marked runnable, in page order."""
    lines = text.splitlines()
    blocks = []
    for index, line in enumerate(lines):
        match = MARKER.match(line)  # at the start of a line: an indented one is an example, not a marker
        if match is None:
            continue
        needs = match.group("needs")
        if needs is not None and needs not in NEEDS:
            raise MarkerError(f"{page}:{index + 1}: runnable marker needs {needs!r}; the marker takes "
                              f"{' or '.join(NEEDS)} (or nothing)")
        fence = FENCE.match(lines[index + 1]) if index + 1 < len(lines) else None
        if fence is None or fence.group("info") != "bash":
            raise MarkerError(f"{page}:{index + 1}: a runnable marker must be followed, on the next line, by a "
                              "```bash fence")
        body = []
        for end in range(index + 2, len(lines)):
            if lines[end].startswith("```"):
                break
            body.append(lines[end])
        else:
            raise MarkerError(f"{page}:{index + 2}: the runnable block is not closed")
        if not any(part.strip() and not part.lstrip().startswith("#") for part in body):
            raise MarkerError(f"{page}:{index + 2}: the runnable block holds no command")
        blocks.append(Block(page=page, line=index + 2, script="\n".join(body) + "\n", needs=needs))
    return blocks


def all_blocks(root: Path) -> list[Block]:
    return [block for path in pages(root)
            for block in runnable_blocks(path.read_text(encoding="utf-8"), str(path.relative_to(root)))]
