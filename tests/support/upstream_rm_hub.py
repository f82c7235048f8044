"""slime's or miles' own rm_hub files, loaded from a directory outside the repository, to score like them.

Set `RAYLESS_SLIME_RM_HUB` (and `RAYLESS_MILES_RM_HUB`) to a directory holding the files of
`slime/rollout/rm_hub/` (`miles/rollout/rm_hub/`) at the commits the corpus names, e.g.

    git --git-dir=SLIME.git archive 624b824a slime/rollout/rm_hub | tar -x -C /tmp/slime
    export RAYLESS_SLIME_RM_HUB=/tmp/slime/slime/rollout/rm_hub

Only the pure-Python graders are loaded (`math_utils`, `math_dapo_utils`, `f1`, `gpqa`, `deepscaler`: sympy and
pylatexenc, both rayless dependencies); their package `__init__` (Ray, aiohttp, slime's types) is not, and
`score` follows its dispatch (`async_rm`) for the built-in names instead. Nothing of theirs is copied here.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
import types
from pathlib import Path
from typing import Any

MODULES = ("math_utils", "math_dapo_utils", "f1", "gpqa", "deepscaler")


def load(variable: str) -> types.SimpleNamespace | None:
    """The graders of the rm_hub directory named by the environment `variable`, or None when it is unset."""
    directory = os.environ.get(variable)
    if not directory:
        return None
    package_name = f"_upstream_rm_hub_{variable.lower()}"
    package = types.ModuleType(package_name)
    package.__path__ = [directory]
    sys.modules[package_name] = package
    loaded = {}
    for name in MODULES:
        spec = importlib.util.spec_from_file_location(f"{package_name}.{name}", Path(directory) / f"{name}.py")
        assert spec is not None and spec.loader is not None, f"{directory}/{name}.py"
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
        loaded[name] = module
    return types.SimpleNamespace(**loaded)


def score(hub: types.SimpleNamespace, rm_type: str, response: str, label: Any, metadata: dict[str, Any],
          tokens: list[int]) -> Any:
    """What upstream's `async_rm` returns for a built-in `rm_type` (dapo: score and acc, as floats)."""
    if rm_type.startswith("boxed_"):
        response = hub.math_utils.extract_answer(response) or ""
        rm_type = rm_type.removeprefix("boxed_")
    if rm_type == "deepscaler":
        return float(hub.deepscaler.get_deepscaler_rule_based_reward(response, label))
    if rm_type == "gemma_math":
        return float(hub.deepscaler.get_gemma_math_reward(response, label))
    if rm_type == "dapo":
        result = hub.math_dapo_utils.compute_score(response, label)
        return {"score": float(result["score"]), "acc": float(result["acc"])}
    if rm_type == "math":
        return 1.0 if hub.math_utils.grade_answer_verl(response, label) else 0.0
    if rm_type == "f1":
        return float(hub.f1.f1_score(response, label)[0])
    if rm_type == "gpqa":
        return float(hub.gpqa.compute_gpqa_reward(response, label, metadata=metadata))
    if rm_type == "deterministic_random":
        return float(hashlib.sha256((str(tokens) + response).encode()).digest()[0] % 2)
    raise KeyError(rm_type)
