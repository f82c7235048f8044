"""SGLang's own weight-sync code, loaded from the real `sglang` wheel that `./run.sh test` installs.

The wheel is installed with `pip install --no-deps --target <site> sglang==0.5.23` (run.sh's
`install_sglang_parts`, recipe B of the research note): its package `__init__` would import triton, zmq,
IPython and more, so nothing here imports `sglang`. Each piece is taken from the installed source files
instead, unchanged: `FlattenedTensorBucket` (`srt/weight_sync/tensor_bucket.py`, which imports only torch),
`init_custom_process_group` (one function of `srt/utils/common.py`, compiled alone), and the two receive
methods of `WeightUpdater` (`srt/model_executor/model_runner_components/weight_updater.py`), called with a
namespace standing in for `self` that holds what they read (`_model_update_group`, `device`).

Where the site is: $RAYLESS_SGLANG_SITE, else `<repo>/.venv/sglang-site`, else `<sys.prefix>/sglang-site`.
A missing site is an error naming the command that installs it, never a skip: CI must run these tests.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

SGLANG_VERSION = "0.5.23"
REPO_ROOT = Path(__file__).resolve().parents[2]


def site_dir() -> Path:
    candidates = [Path(os.environ["RAYLESS_SGLANG_SITE"])] if os.environ.get("RAYLESS_SGLANG_SITE") else []
    candidates += [REPO_ROOT / ".venv" / "sglang-site", Path(sys.prefix) / "sglang-site"]
    for candidate in candidates:
        if (candidate / "sglang" / "srt").is_dir():
            return candidate
    raise RuntimeError(
        f"the sglang {SGLANG_VERSION} wheel is not installed in any of {[str(c) for c in candidates]}: run "
        f"`./run.sh test` (it installs it), or `pip install --no-deps --target .venv/sglang-site "
        f"sglang=={SGLANG_VERSION}`, or point RAYLESS_SGLANG_SITE at such a directory"
    )


def package_dir() -> Path:
    return site_dir() / "sglang"


def installed_version() -> str:
    for info in site_dir().glob("sglang-*.dist-info"):
        return info.name.removeprefix("sglang-").removesuffix(".dist-info")
    raise RuntimeError(f"no sglang-*.dist-info in {site_dir()}")


def _functions(path: Path, names: set[str], class_name: str | None = None) -> list[ast.FunctionDef]:
    tree = ast.parse(path.read_text(), filename=str(path))
    body = tree.body
    if class_name is not None:
        body = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == class_name).body
    found = [n for n in body if isinstance(n, ast.FunctionDef) and n.name in names]
    missing = names - {n.name for n in found}
    if missing:
        raise RuntimeError(f"{path} no longer defines {sorted(missing)}: SGLang's weight-sync code moved")
    return found


def _compile(path: Path, functions: list[ast.FunctionDef], namespace: dict[str, Any]) -> dict[str, Any]:
    for function in functions:  # annotations name types these namespaces do not hold
        function.returns = None
        for arg in function.args.args + function.args.kwonlyargs + function.args.posonlyargs:
            arg.annotation = None
    exec(compile(ast.Module(body=list(functions), type_ignores=[]), str(path), "exec"), namespace)
    return namespace


@functools.cache
def tensor_bucket_module() -> ModuleType:
    path = package_dir() / "srt" / "weight_sync" / "tensor_bucket.py"
    spec = importlib.util.spec_from_file_location("sglang_wheel_tensor_bucket", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up while the class is built
    spec.loader.exec_module(module)
    return module


@functools.cache
def init_custom_process_group() -> Any:
    import torch
    from packaging.version import parse

    path = package_dir() / "srt" / "utils" / "common.py"
    namespace = {"torch": torch, "torch_release": parse(torch.__version__).release}
    return _compile(path, _functions(path, {"init_custom_process_group"}), namespace)["init_custom_process_group"]


@functools.cache
def _receive_methods() -> dict[str, Any]:
    import torch

    path = package_dir() / "srt" / "model_executor" / "model_runner_components" / "weight_updater.py"
    names = {"receive_weights_from_distributed", "_receive_bucketed_weights_from_distributed"}
    namespace = {"torch": torch, "FlattenedTensorBucket": tensor_bucket_module().FlattenedTensorBucket}
    return _compile(path, _functions(path, names, class_name="WeightUpdater"), namespace)


def receive_weights_from_distributed(
    groups: dict[str, Any], *, names: list[str], dtypes: list[str], shapes: list[list[int]], group_name: str,
    load_format: str | None = None, device: str = "cpu",
) -> list[tuple[str, Any]]:
    """SGLang's `WeightUpdater.receive_weights_from_distributed` over `groups` (name → process group)."""
    methods = _receive_methods()
    updater = SimpleNamespace(_model_update_group=groups, device=device)
    # The method calls its bucketed helper through `self`.
    updater._receive_bucketed_weights_from_distributed = functools.partial(
        methods["_receive_bucketed_weights_from_distributed"], updater
    )
    return methods["receive_weights_from_distributed"](
        updater, names=names, dtypes=dtypes, shapes=shapes, group_name=group_name, load_format=load_format
    )


@functools.cache
def template_content_processor() -> Any:
    """SGLang's `process_content_for_template_format` (`srt/parser/jinja_template_utils.py`): a chat message's
    content parts as its chat route hands them to the template, and the image URLs it collects, compiled from
    the installed source with plain stand-ins for the `ImageData` / `VideoData` records it builds."""
    from dataclasses import dataclass, field

    @dataclass
    class MediaData:
        url: str
        detail: Any = "auto"
        max_dynamic_patch: Any = None
        content_hash: Any = None
        max_long_side_pixel: Any = None
        preprocess_kwargs: Any = field(default=None)

    path = package_dir() / "srt" / "parser" / "jinja_template_utils.py"
    namespace = _compile(path, _functions(path, {"process_content_for_template_format"}),
                         {"ImageData": MediaData, "VideoData": MediaData, "GLM_MEDIA_CONFIG_KEYS": ()})
    return namespace["process_content_for_template_format"]
