"""The README and docs/ hold together: every relative link reaches a file (and its `#anchor` a heading of that
file, slugged as GitHub slugs headings), the README stays a front page of at most 12 KB, and the package tree in
docs/architecture.md names every package and module of the code (and no top-level module that is gone)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README_MAX_BYTES = 12_000

FENCE = re.compile(r"^\s*(```|~~~)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
INLINE_CODE = re.compile(r"`[^`]*`")
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
IMAGE = re.compile(r"!\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.IGNORECASE)


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def prose_lines(text: str) -> list[str]:
    """The lines outside fenced code blocks, with inline code removed (links inside code are not links)."""
    lines, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(line)
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup and punctuation dropped, lower case, spaces as hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading anchors on its text
    text = text.replace("`", "").lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    found: set[str] = set()
    seen: dict[str, int] = {}
    for line in prose_lines(path.read_text(encoding="utf-8")):
        match = HEADING.match(line)
        if not match:
            continue
        base = slug(match.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def links(path: Path) -> list[str]:
    targets = []
    for line in prose_lines(path.read_text(encoding="utf-8")):
        line = INLINE_CODE.sub("", line)
        targets += LINK.findall(line) + IMAGE.findall(line)
    return targets


def test_slugs_are_githubs() -> None:
    assert slug("Porting from slime / miles") == "porting-from-slime--miles"
    assert slug("On a GPU node: placement, `--dry-run`, the engine backend") == (
        "on-a-gpu-node-placement---dry-run-the-engine-backend")
    assert slug("What `coordinator.hooks` gives a hook") == "what-coordinatorhooks-gives-a-hook"


def test_the_docs_exist_and_the_readme_links_every_page() -> None:
    docs = sorted(p.name for p in (ROOT / "docs").glob("*.md"))
    assert "architecture.md" in docs and "README.md" in docs
    readme_targets = {t.split("#")[0] for t in links(ROOT / "README.md")}
    index_targets = {t.split("#")[0] for t in links(ROOT / "docs" / "README.md")}
    for name in docs:
        if name != "README.md":
            assert f"docs/{name}" in readme_targets, f"README.md does not link docs/{name}"
            assert name in index_targets, f"docs/README.md does not link {name}"


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page: Path) -> None:
    broken = []
    for target in links(page):
        if EXTERNAL.match(target):
            continue
        file_part, _, anchor = target.partition("#")
        dest = (page.parent / file_part).resolve() if file_part else page
        if not dest.exists():
            broken.append(f"{target}: no file {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading with anchor #{anchor} in {dest.name}")
    assert not broken, f"{page.relative_to(ROOT)}: broken links:\n  " + "\n  ".join(broken)


def test_the_readme_is_a_front_page() -> None:
    size = len((ROOT / "README.md").read_bytes())
    assert size <= README_MAX_BYTES, f"README.md is {size} bytes; at most {README_MAX_BYTES}: move detail to docs/"


PACKAGES = ("coordinator", "workers", "replay")


def architecture_tree() -> str:
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    section = text.split("## The package tree", 1)[1]
    return section.split("```", 2)[1]


def test_the_architecture_tree_names_every_package_and_module() -> None:
    tree = architecture_tree()
    names = set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*(?:\.py|/)?", tree))
    missing = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            relative = path.relative_to(ROOT)
            if path.name == "__init__.py":
                if path.parent.name != package and f"{path.parent.name}/" not in names:
                    missing.append(f"{relative.parent}/")
            elif path.parent.name == package:
                if path.name not in names:  # a top-level module is listed by file name
                    missing.append(str(relative))
            elif path.stem not in names and path.stem.strip("_") not in names:
                missing.append(str(relative))  # a package's module is named in its package's line
    assert not missing, "docs/architecture.md's package tree does not name: " + ", ".join(missing)


def test_the_architecture_tree_names_no_module_that_is_gone() -> None:
    tree = architecture_tree()
    section = None
    gone = []
    for line in tree.splitlines():
        top = re.match(r"^([a-z_]+)/\s", line)
        if top:
            section = top.group(1)
            continue
        module = re.match(r"^  ([a-z_]+\.py)\s", line)
        if module and section in PACKAGES and not (ROOT / section / module.group(1)).exists():
            gone.append(f"{section}/{module.group(1)}")
    assert not gone, "docs/architecture.md's package tree names modules that do not exist: " + ", ".join(gone)
