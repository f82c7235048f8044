"""The docs as tests: every shell block README.md and docs/*.md mark runnable runs as written, on the tiny model.

The convention (`<!-- runnable -->` before a ```bash block) is docs/testing.md's; `tests/support/doc_commands.py`
extracts the blocks. Each page's blocks run in page order, each with `bash -euo pipefail`, from the root of a
fresh copy of this checkout of the page's own (the files `git ls-files` lists, as a clone has them, plus
`runs/tiny-model`, which `./run.sh` builds first). `rayless` is the venv's (its bin first on PATH, as `./run.sh`
sets it) and imports the copy's packages, as the editable install of a clone does; nothing else is on the
path, so a block that needs `PYTHONPATH=.` must say so. Pages run two at a time (CI has 2 cores). A block
marked `gpu` runs only where CUDA is, one marked `multi-node` never here: each skipped by name.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.doc_commands import Block, all_blocks

ROOT = Path(__file__).resolve().parents[2]
BLOCKS = all_blocks(ROOT)  # a marker that marks no bash block fails here, naming its page and line
PAGES = list(dict.fromkeys(block.page for block in BLOCKS))
PACKAGES = ("coordinator", "workers", "replay")  # what `pip install -e .` makes importable (pyproject.toml)
PARALLEL_PAGES = 2

pytestmark = pytest.mark.timeout(1200)  # every page's commands run in the first test's fixture


@dataclass
class Outcome:
    block: Block
    returncode: int | None  # None: skipped
    output: str
    cpu_s: float


#: What a clone does not hold (.gitignore's entries), for a checkout that is not a git work tree.
NOT_IN_A_CLONE = frozenset({".git", ".venv", "__pycache__", "runs", ".ruff_cache", ".hypothesis", "build", "tmp",
                            ".pytest_cache"})


def clone_files() -> list[str]:
    """The checkout's files as a clone of it holds them: what git lists (tracked, and new files not ignored), or,
    outside a git work tree, every file but the ignored directories."""
    try:
        listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                                capture_output=True, check=True).stdout.split(b"\0")
        return [os.fsdecode(name) for name in listed if name]
    except (OSError, subprocess.CalledProcessError):
        return [str(path.relative_to(ROOT)) for path in ROOT.rglob("*")
                if path.is_file() and not any(part in NOT_IN_A_CLONE or part.endswith(".egg-info")
                                              for part in path.relative_to(ROOT).parts)]


def fresh_copy(directory: Path, tiny_model: Path) -> tuple[Path, Path]:
    """A clone's files under `directory/repo`, `runs/tiny-model` in it, and a directory holding only the
    installed packages (linked to the copy's) for PYTHONPATH: (copy root, that directory)."""
    repo = directory / "repo"
    for name in clone_files():
        source = ROOT / name
        if source.is_file():  # a tracked file deleted in this working tree is not in a clone of it either
            target = repo / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
    shutil.copytree(tiny_model, repo / "runs" / "tiny-model")
    site = directory / "site"
    site.mkdir()
    for package in PACKAGES:
        (site / package).symlink_to(repo / package, target_is_directory=True)
    return repo, site


def skip_reason(block: Block) -> str | None:
    if block.needs == "multi-node":
        return f"{block.where}: needs several nodes"
    if block.needs == "gpu":
        import torch

        if not torch.cuda.is_available():
            return f"{block.where}: needs a GPU"
    return None


def run_page(page: str, directory: Path, tiny_model: Path) -> list[Outcome]:
    repo, site = fresh_copy(directory, tiny_model)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
           "PYTHONPATH": str(site), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    outcomes = []
    for index, block in enumerate(block for block in BLOCKS if block.page == page):
        reason = skip_reason(block)
        if reason is not None:
            outcomes.append(Outcome(block, None, reason, 0.0))
            continue
        times = directory / f"times-{index}.txt"
        # `times` on exit: the CPU time of the block's processes (its second line: the children's user, system)
        script = f"trap 'times > {times}' EXIT\nset -euo pipefail\n{block.script}"
        try:
            done = subprocess.run(["bash", "-c", script], cwd=repo, env=env, capture_output=True, text=True,
                                  timeout=600, check=False)
            returncode, output = done.returncode, done.stdout + done.stderr
        except subprocess.TimeoutExpired as timeout:
            returncode, output = -1, f"timed out after {timeout.timeout} s"
        outcomes.append(Outcome(block, returncode, output, cpu_seconds(times)))
    return outcomes


def cpu_seconds(times: Path) -> float:
    """The children's user + system seconds from bash's `times` output (`0m1.250s 0m0.100s`)."""
    try:
        line = times.read_text().splitlines()[1]
    except (OSError, IndexError):
        return 0.0
    total = 0.0
    for part in line.split():
        minutes, seconds = part.rstrip("s").split("m")
        total += 60 * float(minutes) + float(seconds)
    return total


@pytest.fixture(scope="module")
def outcomes(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, list[Outcome]]]:
    with ThreadPoolExecutor(max_workers=PARALLEL_PAGES) as pool:
        futures = {page: pool.submit(run_page, page, tmp_path_factory.mktemp("docs"), tiny_model_dir)
                   for page in PAGES}
        results = {page: future.result() for page, future in futures.items()}
    for outcome in (outcome for page in results.values() for outcome in page):  # shown with -s: the budget
        print(f"docs command {outcome.block.where}: "
              f"{'skipped' if outcome.returncode is None else f'{outcome.cpu_s:.1f} CPU-s'}")
    yield results


@pytest.mark.parametrize("page", PAGES)
def test_each_runnable_command_runs_as_written(page: str, outcomes: dict[str, list[Outcome]]) -> None:
    ran = [outcome for outcome in outcomes[page] if outcome.returncode is not None]
    failed = [outcome for outcome in ran if outcome.returncode != 0]
    assert not failed, "\n\n".join(f"{o.block.where} exited {o.returncode}:\n{o.block.script}\n--- output (end):\n"
                                   f"{o.output[-3000:]}" for o in failed)
    if not ran:
        pytest.skip("; ".join(outcome.output for outcome in outcomes[page]))
