"""The bounds tables of the docs match the code: docs/fault-tolerance.md's "Every wait has a bound" (each flag it
names exists with the default it states; the bounds without a flag are the code's constants — the generation
bound's derivation, the eval pin's per-call bound, node registration's — every waiting flag of the code is in it) and docs/hooks.md's "Bounds on user code" (each hook kind's flag and default are
`coordinator.hooks.calls`' and the config's)."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

from coordinator.config.flags import FLAGS
from coordinator.engines.client import DEFAULT_MAX_NEW_TOKENS, EngineClient
from coordinator.engines.fleet import EngineFleet
from coordinator.engines.stall import PROBE_S, STALL_BYTES
from coordinator.eval.fleet import EvalFleet
from coordinator.hooks.calls import DEFAULT_LIMITS, DEFAULT_MAX_IN_A_ROW, LIMIT_FLAGS
from coordinator.nodes.registry import NodeRegistry
from coordinator.observe.rank_watch import DEADLINE_TIMES, SLOWER_THAN_BEFORE
from coordinator.rollout.dispatch import Dispatcher
from coordinator.train.group import TrainGroup

DOCS = Path(__file__).resolve().parents[2] / "docs"
#: the flags that bound a wait: each must have its row
WAITING_FLAGS = ("--engine-stall-timeout-s", "--rollout-health-check-interval", "--rollout-health-check-timeout",
                 "--update-weight-join-timeout", "--rank-call-warn-s", "--train-pg-timeout-s",
                 "--loop-stall-warn-s", "--hook-max-failures-in-a-row", "--engine-token-timeout-s",
                 "--update-weight-ack-timeout", "--rank-call-timeout-s", *LIMIT_FLAGS.values())


def table(page: str, heading: str) -> list[list[str]]:
    """The rows (cells stripped) of the first table after `heading` on `page`."""
    text = (DOCS / page).read_text(encoding="utf-8").split(heading, 1)[1]
    lines = ("| " + text.split("\n\n| ", 1)[1]).splitlines()
    rows = lines[:next(i for i, line in enumerate(lines) if not line.startswith("|"))]
    return [[cell.strip() for cell in row.strip("|").split(" | ")] for row in rows[2:]]  # no header, no rule


def default(flag: str) -> float:
    return float(FLAGS[flag.removeprefix("--").replace("-", "_")][1].default)


def seconds(cell: str) -> list[float]:
    return [float(number) for number in re.findall(r"(\d+(?:\.\d+)?) s\b", cell)]


def test_the_wait_table_states_each_flags_default_and_the_codes_constants() -> None:
    rows = table("fault-tolerance.md", "## Every wait has a bound")
    flags_named = set()
    for wait, bound, stated, _ in rows:
        flags = re.findall(r"`(--[a-z0-9-]+)`", bound)
        flags_named.update(flags)
        if len(flags) == 1 and re.fullmatch(r"[\d.]+( s)?( \([\d.]+ s\))?", stated):
            assert float(re.match(r"[\d.]+", stated).group()) == default(flags[0]), (wait, stated)  # type: ignore[union-attr]
    assert not set(WAITING_FLAGS) - flags_named - set(LIMIT_FLAGS.values())
    by_wait = {row[0]: row for row in rows}
    head = by_wait["an answer's head from an engine (a request whose read timeout is longer than the stall bound)"]
    assert seconds(head[2]) == [default("--engine-stall-timeout-s"), PROBE_S]
    assert "64 KiB" in by_wait["an engine's reply body, or a streamed event once it began"][1]
    assert STALL_BYTES == 64 << 10
    generate_timeout = inspect.signature(EngineClient).parameters["generate_timeout"].default
    assert seconds(by_wait["a `/generate` answer's head, or the gap between two stream events"][2]) == [generate_timeout]
    engine_wait = inspect.signature(Dispatcher).parameters["engine_wait"].default
    assert seconds(by_wait["an alive engine to send a request to"][2]) == [engine_wait]
    monitor = by_wait["an engine that answers `/health` but finishes no generation"][2]
    threshold = default("--rollout-health-check-failure-threshold")
    assert monitor == (f"{threshold:g} × {default('--rollout-health-check-interval'):g} s + "
                       f"{default('--rollout-health-check-timeout'):g} s")
    generation = by_wait["a non-streamed `/generate` answer from an engine that answers `/health` (a request's "
                         "generation bound)"]
    assert f"SGLang's {DEFAULT_MAX_NEW_TOKENS} when it names none" in generation[1]
    assert generation[2] == (f"{default('--engine-stall-timeout-s'):g} s + max_new_tokens × "
                             f"{default('--engine-token-timeout-s'):g} s")
    client = EngineClient()
    bound, derived = client.generation_bound({"sampling_params": {"max_new_tokens": 64}})
    assert f"no answer within {bound:g} s, the bound of its request: {derived.split(' (')[0]}" in generation[3]
    pin = inspect.signature(EvalFleet).parameters["timeout"].default
    assert seconds(by_wait["each engine call of an eval pin (load, version, 1-token generate)"][2]) == [pin]
    nodes = by_wait["a node's processes registering with node 0"][2]
    assert seconds(nodes) == [NodeRegistry.handshake_timeout_s,
                              inspect.signature(TrainGroup).parameters["start_timeout_s"].default,
                              inspect.signature(EngineFleet).parameters["attach_timeout"].default]
    resume = by_wait["the resume path"][2]
    assert seconds(resume) == [default("--rank-call-timeout-s"), default("--update-weight-ack-timeout")]
    assert "3× the longest" in by_wait["a command to the training ranks"][1] and SLOWER_THAN_BEFORE == 3
    assert f"{DEADLINE_TIMES:g}× the longest" in by_wait["a command to the training ranks, to its end"][1]
    hooks = by_wait["one call of a user hook (agent, generate, reward, filter, rollout function)"][2]
    assert seconds(hooks) == [min(DEFAULT_LIMITS.values()), max(DEFAULT_LIMITS.values())]
    budget = by_wait["failures in a row of one hook kind"]
    assert float(budget[2]) == default("--hook-max-failures-in-a-row") == DEFAULT_MAX_IN_A_ROW


def test_the_hook_table_is_the_code_kind_by_kind() -> None:
    rows = table("hooks.md", "## Bounds on user code")
    kinds = {row[0].split(" ", 1)[0]: row for row in rows}
    assert set(kinds) == set(LIMIT_FLAGS)
    for kind, (_, flag, stated, _) in kinds.items():
        assert flag == f"`{LIMIT_FLAGS[kind]}`", kind
        assert seconds(stated) == [DEFAULT_LIMITS[kind]] == [default(LIMIT_FLAGS[kind])], kind
