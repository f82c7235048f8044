"""The layering of the code, checked on the import graph (every import statement, lazy and type-only ones
included: a type-only import is still a dependency a reader must follow).

`coordinator`'s packages, from the bottom up; a module may import its own package and the layers below it,
never a layer above, and two packages of one layer never import each other. `replay` and `workers` are below
the whole coordinator and never import it (the ranks and the engine run without the coordinator's code).
docs/architecture.md draws the same layers.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LAYERS: list[set[str]] = [
    {"rewards", "data"},  # the graders: pure functions of a response and a label; prompt and eval data
    {"config"},  # the flags: slices, the parser, derived facts
    {"lifecycle"},  # process groups, stop signals, failure reports, logging set-up
    {"observe"},  # start-up board, progress, metrics log
    {"engines", "train"},  # the engine fleet, its client and health; the training ranks' group
    {"weights", "tinker"},  # the weight sync and the colocated hand-over; the Tinker API service
    {"hooks"},  # the hook API user code imports
    {"rollout"},  # prompts, generation, rewards, filters, advantages, the hook endpoint
    {"eval", "sessions"},  # evaluation; miles' session server for OpenAI-API agents
    {"plan"},  # the placement plan and the multi-node layout
    {"nodes"},  # node 0's registry, node k's agent
    {"checks"},  # start-up checks and the dry run
    {"status"},  # the status server, its document and metrics, `rayless status`
    {"loop"},  # the training loop, against its protocols
    {"services"},  # the run's services, built complete, then started
    {"run"},  # `rayless train`'s wiring
    {"cli"},  # the command line
]
LAYER_OF = {package: index for index, layer in enumerate(LAYERS) for package in layer}
#: `workers`' packages and top-level modules, from the bottom up, by the same rule: the engine and the training
#: ranks are separate processes and never import each other; what both run is below them.
WORKER_LAYERS: list[set[str]] = [
    {"errors", "host_memory", "lifeline", "stack_dumps", "collector"},  # leaves: no import of ours
    {"boundary"},  # every byte from a peer or a file decoded through it
    # the control channel's messages; hook paths; the tiny model; the vision-language processor (one rule for
    # image placeholders, shared by the coordinator, the engine and the ranks)
    {"protocol", "hook_loading", "tiny_model", "vlm_processor"},
    {"shared_torch", "tiny_vlm"},  # torch code both the engine and the ranks run; the tiny VLM (on tiny_model)
    {"engine", "train_rank"},  # the two kinds of worker process
]
WORKER_LAYER_OF = {part: index for index, layer in enumerate(WORKER_LAYERS) for part in layer}
OURS = ("coordinator", "workers", "replay")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> list[tuple[str, int]]:
    """Every module a file imports. `from pkg import name` imports `pkg`, and `pkg.name` too when that is a
    module of ours (`from workers.train_rank import lora` depends on `lora`, not only on the package)."""
    modules = set(our_modules())
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found += [(node.module, node.lineno)]
            found += [(f"{node.module}.{alias.name}", node.lineno) for alias in node.names
                      if f"{node.module}.{alias.name}" in modules]
        elif isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
    return [(name, line) for name, line in found if name.split(".")[0] in OURS]


def our_modules() -> dict[str, Path]:
    return {module_name(path): path for top in OURS for path in sorted((ROOT / top).rglob("*.py"))}


def coordinator_package(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "coordinator" and len(parts) > 1 else None


def worker_part(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "workers" and len(parts) > 1 else None


def worker_layer_violations(modules: dict[str, Path]) -> list[str]:
    wrong = []
    for name, path in modules.items():
        source = worker_part(name)
        if source is None:
            continue
        for target, line in imports_of(path):
            target_part = worker_part(target)
            if target_part is None or target_part == source:
                continue
            if WORKER_LAYER_OF[target_part] > WORKER_LAYER_OF[source]:
                wrong.append(f"{name}:{line} imports {target}: workers.{target_part} is above workers.{source}")
            elif WORKER_LAYER_OF[target_part] == WORKER_LAYER_OF[source]:
                wrong.append(f"{name}:{line} imports {target}: workers.{target_part} and workers.{source} "
                             "share a layer")
    return wrong


def test_every_workers_part_has_a_layer() -> None:
    parts = {worker_part(name) for name in our_modules()} - {None}
    assert parts == set(WORKER_LAYER_OF), "a new part of workers/ needs its place in WORKER_LAYERS"


def test_workers_are_layered_and_the_engine_and_the_ranks_never_import_each_other() -> None:
    wrong = worker_layer_violations(our_modules())
    assert not wrong, "\n".join(wrong)


def test_every_coordinator_package_has_a_layer() -> None:
    packages = {coordinator_package(name) for name in our_modules()} - {None}
    assert packages == set(LAYER_OF), "a new package needs its place in LAYERS (and in docs/architecture.md)"


def test_no_upward_import_and_no_import_between_packages_of_one_layer() -> None:
    wrong = []
    for name, path in our_modules().items():
        top, source = name.split(".")[0], coordinator_package(name)
        for target, line in imports_of(path):
            if top in ("workers", "replay"):
                if target.split(".")[0] == "coordinator":
                    wrong.append(f"{name}:{line} imports {target}: workers and replay never import the coordinator")
                continue
            target_package = coordinator_package(target)
            if source is None or target_package is None or target_package == source:
                continue
            if LAYER_OF[target_package] > LAYER_OF[source]:
                wrong.append(f"{name}:{line} imports {target}: {target_package} is above {source}")
            elif LAYER_OF[target_package] == LAYER_OF[source]:
                wrong.append(f"{name}:{line} imports {target}: {target_package} and {source} share a layer")
    assert not wrong, "\n".join(wrong)


def module_graph() -> dict[str, set[str]]:
    modules = our_modules()
    graph: dict[str, set[str]] = defaultdict(set)
    for name, path in modules.items():
        for target, _ in imports_of(path):
            # `from pkg import module` names the module; `from pkg.module import name` the module itself
            while target not in modules and "." in target:
                target = target.rsplit(".", 1)[0]
            if target in modules and target != name:
                graph[name].add(target)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for target in sorted(graph.get(node, ())):
            if state.get(target) == 1:
                return [*path[path.index(target):], target]
            if target not in state and (cycle := visit(target)) is not None:
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)) is not None:
            return cycle
    return None


def test_no_import_cycle_between_modules() -> None:
    # a package's facade (`__init__`) importing its own modules is not a cycle through them
    graph = module_graph()
    for name in list(graph):
        graph[name] = {target for target in graph[name] if not name.startswith(f"{target}.")}
    cycle = find_cycle(graph)
    assert cycle is None, " -> ".join(cycle or [])


def test_a_package_facade_re_exports_only_its_own_modules() -> None:
    wrong = []
    for name, path in our_modules().items():
        if path.name != "__init__.py":
            continue
        for target, line in imports_of(path):
            if not target.startswith(f"{name}.") and target != name:
                wrong.append(f"{name}/__init__.py:{line} imports {target}")
    # `coordinator.hooks` and `replay` carry `replay.sample.Sample` / workers' errors as part of the API
    # their users import; that is the one kind of re-export from elsewhere, listed here by name.
    allowed = {"coordinator.hooks/__init__.py", "replay/__init__.py"}
    assert [row for row in wrong if row.split(":")[0] not in allowed] == []


def test_the_layer_test_sees_a_module_imported_from_its_package_and_a_worker_crossing(tmp_path: Path) -> None:
    # `from pkg import module` is a dependency on the module: a planted lora <-> weight_export cycle is found
    modules = dict(our_modules())
    planted = tmp_path / "workers" / "train_rank"
    planted.mkdir(parents=True)
    (planted / "lora.py").write_text("from workers.train_rank import weight_export\n")
    (planted / "weight_export.py").write_text("from workers.train_rank import lora\n")
    modules["workers.train_rank.lora"] = planted / "lora.py"
    modules["workers.train_rank.weight_export"] = planted / "weight_export.py"
    assert imports_of(planted / "lora.py") == [("workers.train_rank", 1), ("workers.train_rank.weight_export", 1)]
    graph = {name: {t for t, _ in imports_of(path) if t in modules and t != name} for name, path in
             modules.items() if name.startswith("workers.train_rank.")}
    assert find_cycle(graph) is not None
    # the engine importing the ranks' code is refused
    (planted / "crossing.py").write_text("from workers.train_rank import trainer\n")
    crossing = {"workers.engine.crossing": planted / "crossing.py"}
    assert worker_layer_violations(crossing) == [
        "workers.engine.crossing:1 imports workers.train_rank: workers.train_rank and workers.engine share a layer",
        "workers.engine.crossing:1 imports workers.train_rank.trainer: workers.train_rank and workers.engine "
        "share a layer"]


def test_the_layer_test_sees_an_upward_import(tmp_path: Path) -> None:
    # the checker itself: an upward import written into a module is reported
    module = tmp_path / "probe.py"
    module.write_text("from coordinator.run import run_training\n")
    assert imports_of(module) == [("coordinator.run", 1)]
    assert LAYER_OF["run"] > LAYER_OF["config"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
