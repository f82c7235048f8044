"""Resolves user hook paths (`--custom-rm-path`, `--rollout-function-path`, `--custom-tis-function-path`, ...) to
Python objects, in the coordinator and on the training ranks alike.

Owns the one rule for hook paths: `package.module:Name` (attribute path after the colon, dots allowed) or
`package.module.Name` (the longest importable module prefix wins). Invariant: a failure always raises
`HookLoadError` naming the flag and the path, never a bare ImportError/AttributeError from deep inside;
an ImportError raised *inside* the user's module (a missing dependency of theirs) is reported as such.
"""

from __future__ import annotations

import importlib
from typing import Any

from workers.errors import RaylessError


class HookLoadError(RaylessError, ValueError):
    """A hook path that names no importable object."""


def _import_module(module_name: str, *, what: str, path: str) -> Any | None:
    """Import `module_name`; None when that module (or a parent package of it) does not exist."""
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        # Only "this module does not exist" means "try another split"; a module that exists but fails
        # to import one of *its* dependencies is the user's bug and must be reported as such.
        missing = error.name or ""
        if missing == module_name or module_name.startswith(missing + "."):
            return None
        raise HookLoadError(f"{what} {path!r}: importing module {module_name!r} failed: {error}") from error
    except Exception as error:  # the user's module raised while importing
        raise HookLoadError(
            f"{what} {path!r}: importing module {module_name!r} raised {type(error).__name__}: {error}"
        ) from error


def _resolve_attribute(module: Any, module_name: str, attributes: list[str], *, what: str, path: str) -> Any:
    target = module
    walked = module_name
    for attribute in attributes:
        if not hasattr(target, attribute):
            raise HookLoadError(f"{what} {path!r}: {walked!r} has no attribute {attribute!r}")
        target = getattr(target, attribute)
        walked = f"{walked}.{attribute}"
    return target


def load_object(path: str, *, what: str) -> Any:
    """Return the object named by `path` (`module.path:Name` or `module.path.Name`).

    `what` is the flag the path came from (e.g. "--custom-rm-path"); every error message starts with it.
    """
    if not isinstance(path, str) or not path.strip():
        raise HookLoadError(f"{what}: expected 'module.path:Name' or 'module.path.Name', got {path!r}")
    path = path.strip()
    if ":" in path:
        module_name, _, attribute_path = path.partition(":")
        attributes = attribute_path.split(".") if attribute_path else []
        if not module_name or not attributes or any(not part for part in attributes) or ":" in attribute_path:
            raise HookLoadError(f"{what} {path!r}: expected 'module.path:Name' (one colon, a name after it)")
        module = _import_module(module_name, what=what, path=path)
        if module is None:
            raise HookLoadError(f"{what} {path!r}: module {module_name!r} not found (is it on PYTHONPATH?)")
        return _resolve_attribute(module, module_name, attributes, what=what, path=path)

    parts = path.split(".")
    if len(parts) < 2 or any(not part for part in parts):
        raise HookLoadError(f"{what} {path!r}: expected 'module.path:Name' or 'module.path.Name'")
    # Longest importable prefix first: `a.b.C` is module `a.b`, attribute `C`; `a.b.C.f` may be `a.b:C.f`.
    for split in range(len(parts) - 1, 0, -1):
        module_name = ".".join(parts[:split])
        module = _import_module(module_name, what=what, path=path)
        if module is not None:
            return _resolve_attribute(module, module_name, parts[split:], what=what, path=path)
    raise HookLoadError(f"{what} {path!r}: no module found for any prefix of it (is it on PYTHONPATH?)")
