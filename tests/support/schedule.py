"""The order test files reach pytest-xdist's workers: the costliest first, from a table of measured costs.

`./run.sh test` runs the suite in two workers, a file at a time (`--dist loadfile`); the wall time is the
longer worker's sum, so a long file that starts last leaves the other worker idle while it runs. pytest-xdist
orders files by their number of tests (`--loadscope-reorder`, its default), which puts the many cheap unit
tests first and the integration files of one or two long tests last. This plugin turns that off and orders the
files by `file_costs.json` instead (seconds per file, setup and teardown included, from a `--durations=0` run;
docs/testing.md says how it was measured and how to refresh it): longest first, the greedy order that keeps
the two workers' sums close. Invariant: it changes only the order of whole files, never which tests run or
the order of the tests inside a file, and only in xdist's workers (a run in one process keeps pytest's order).
A file the table does not know yet is placed as an integration file of `UNKNOWN_INTEGRATION_S` (a unit file
as free): better early than a surprise at the end.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

TABLE = Path(__file__).with_name("file_costs.json")
UNKNOWN_INTEGRATION_S = 30.0


def file_costs() -> dict[str, float]:
    return {path: float(seconds) for path, seconds in json.loads(TABLE.read_text()).items()}


def cost(path: str, costs: dict[str, float]) -> float:
    if path in costs:
        return costs[path]
    return UNKNOWN_INTEGRATION_S if "/integration/" in path else 0.0


@pytest.hookimpl(trylast=True)
def pytest_configure(config: pytest.Config) -> None:
    # In the controlling process: keep the collection's order (ours, below) instead of xdist's by-count order.
    if getattr(config.option, "dist", "no") in ("loadfile", "loadscope") and hasattr(config.option,
                                                                                        "loadscopereorder"):
        config.option.loadscopereorder = False


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not hasattr(config, "workerinput"):  # not an xdist worker: the order does not change the wall time
        return
    costs = file_costs()
    # A stable sort on the file's cost alone: each file's tests stay together and in their order.
    items.sort(key=lambda item: -cost(item.nodeid.split("::", 1)[0], costs))
