"""The reply check against SGLang's own finish reasons: every `BaseFinishReason` subclass of the installed wheel's
`srt/managers/schedule_batch.py`, compiled alone from its source, gives a `to_json()` that `check_finish` accepts,
and their `type`s are exactly the set the check knows (a new kind in SGLang fails here, not in a run)."""

from __future__ import annotations

import ast
from typing import Any

from coordinator.engines.replies import FINISH_TYPES, check_finish
from tests.support.sglang_parts import package_dir

#: constructor arguments per SGLang class (by the kinds of `matched` its signature admits)
ARGUMENTS: dict[str, list[tuple[Any, ...]]] = {
    "FINISH_MATCHED_TOKEN": [(5,), ([5, 6],)],
    "FINISH_MATCHED_STR": [("</s>",)],
    "FINISHED_MATCHED_REGEX": [("[0-9]+",)],
    "FINISH_LENGTH": [(16,)],
    "FINISH_ABORT": [(), ("paused", 503, "ServiceUnavailable")],
}


def sglang_finish_reasons() -> dict[str, type]:
    path = package_dir() / "srt" / "managers" / "schedule_batch.py"
    tree = ast.parse(path.read_text(), filename=str(path))
    names = {"BaseFinishReason"}
    classes = []
    for node in tree.body:  # subclasses follow their base in the file
        if isinstance(node, ast.ClassDef) and (node.name in names or any(
                isinstance(base, ast.Name) and base.id in names for base in node.bases)):
            names.add(node.name)
            classes.append(node)
    namespace: dict[str, Any] = {}
    exec(compile(ast.Module(body=classes, type_ignores=[]), str(path), "exec"), namespace)
    return {name: namespace[name] for name in names - {"BaseFinishReason"}}


def test_every_sglang_finish_reason_passes_and_the_known_set_is_sglangs() -> None:
    reasons = sglang_finish_reasons()
    assert set(reasons) == set(ARGUMENTS), "SGLang's finish reasons changed: add the new ones here"
    kinds = set()
    for name, cls in reasons.items():
        for args in ARGUMENTS[name]:
            value = cls(*args).to_json()
            checked = check_finish(value, "http://127.0.0.1:30000", stream=False)
            assert checked is not None and checked.type == value["type"]
            kinds.add(value["type"])
    assert kinds == FINISH_TYPES
