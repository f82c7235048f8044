"""The runnable-marker convention of the docs-as-tests test (tests/support/doc_commands.py, docs/testing.md)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.doc_commands import MarkerError, all_blocks, runnable_blocks

PAGE = """# A page

```bash
rayless train --not-marked
```

<!-- runnable -->
```bash
rayless make-tiny-model runs/m   # a comment stays
rayless train --hf-checkpoint runs/m \\
    --num-rollout 2
```

<!-- runnable: gpu -->
```bash
rayless train --colocate
```

An indented marker is an example of the convention, not a marker:

    <!-- runnable -->
    ```bash
    rayless train --example
    ```
"""


def test_only_marked_bash_blocks_are_taken_whole_with_their_line_and_needs() -> None:
    blocks = runnable_blocks(PAGE, "docs/x.md")
    assert [(b.where, b.needs) for b in blocks] == [("docs/x.md:8", None), ("docs/x.md:15", "gpu")]
    assert blocks[0].script == ("rayless make-tiny-model runs/m   # a comment stays\n"
                                "rayless train --hf-checkpoint runs/m \\\n    --num-rollout 2\n")


@pytest.mark.parametrize(("text", "message"), [
    ("<!-- runnable -->\n\n```bash\nls\n```\n", "docs/x.md:1: a runnable marker must be followed"),
    ("<!-- runnable -->\n```python\nprint()\n```\n", "docs/x.md:1: a runnable marker must be followed"),
    ("<!-- runnable: tpu -->\n```bash\nls\n```\n", "docs/x.md:1: runnable marker needs 'tpu'"),
    ("<!-- runnable -->\n```bash\nls\n", "docs/x.md:2: the runnable block is not closed"),
    ("<!-- runnable -->\n```bash\n# nothing\n```\n", "docs/x.md:2: the runnable block holds no command"),
])
def test_a_marker_that_marks_nothing_runnable_is_an_error_naming_the_line(text: str, message: str) -> None:
    with pytest.raises(MarkerError, match=message):
        runnable_blocks(text, "docs/x.md")


def test_the_repository_docs_follow_the_convention() -> None:
    """Every marker in README.md and docs/*.md marks a bash block (what the integration test then runs)."""
    blocks = all_blocks(Path(__file__).resolve().parents[2])
    assert blocks, "no runnable block in the docs"
    assert {block.page for block in blocks} >= {"docs/sft.md", "docs/lora.md", "docs/distillation.md"}
