"""Reading the flags an upstream parser defines from its source text, without importing it.

Owns the static reading (Python's `ast`) of three ways upstream declares flags:
- `parser.add_argument("--flag", ...)` / `group.add_argument(...)` / slime's `reset_arg(parser, "--flag", ...)`,
  names given as string literals or f-strings over a known prefix (sglang-router's `f"--{prefix}policy"`);
- Megatron-LM's `ArgumentGroupFactory(SomeConfig, exclude=[...])`: one flag per dataclass field (a bool
  defaulting to False is `--x`, any other bool `--no-x` / `--disable-x`; `argparse_meta` overrides the names);
- miles' FSDP backend, `dataclasses.fields(FSDPArgs)`: `--x` per field, bools with `--no-x` as well.

Invariant: a flag's arity (what follows it on a command line) is read from `action` / `nargs` as argparse
would apply them: `switch` (nothing), `value` (one token), `values` (one or more), `optional` (zero or one),
`N` (exactly N). Nothing here executes upstream code.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Callable, Iterable

Flags = dict[str, str]  # flag → arity

_SWITCH_ACTIONS = {"store_true", "store_false", "store_const", "append_const", "count", "help", "version"}


def _literal(node: ast.AST | None) -> object:
    try:
        return ast.literal_eval(node) if node is not None else None
    except (ValueError, TypeError, SyntaxError, RecursionError):
        return None


def _name_of(node: ast.AST, prefixes: dict[str, tuple[str, ...]]) -> list[str]:
    """The flag names a name argument stands for: a literal, or an f-string over a known prefix variable."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if not isinstance(node, ast.JoinedStr):
        return []
    results = [""]
    for part in node.values:
        if isinstance(part, ast.Constant) and isinstance(part.value, str):
            results = [text + part.value for text in results]
        elif isinstance(part, ast.FormattedValue) and isinstance(part.value, ast.Name) \
                and part.value.id in prefixes:
            results = [text + value for text in results for value in prefixes[part.value.id]]
        else:
            return []
    return results


def arity(action: object, nargs: object, *, optional_bool: bool = False) -> str:
    if optional_bool or action in _SWITCH_ACTIONS:
        return "switch"
    if nargs in ("+", "*"):
        return "values"
    if nargs == "?":
        return "optional"
    if isinstance(nargs, int):
        return "switch" if nargs == 0 else str(nargs)
    return "value"


def _add(flags: Flags, names: Iterable[str], kind: str, *, negatable: bool = False) -> None:
    for name in names:
        if name.startswith("--") and len(name) > 2:
            flags.setdefault(name, kind)
            if negatable:
                flags.setdefault("--no-" + name[2:], "switch")


def _call_name(node: ast.Call) -> str | None:
    func = node.func
    if isinstance(func, ast.Attribute):
        return func.attr
    if isinstance(func, ast.Name):
        return func.id
    return None


def add_argument_flags(tree: ast.AST, prefixes: dict[str, tuple[str, ...]] | None = None) -> Flags:
    """Every flag of the `add_argument` / `reset_arg` calls in `tree`."""
    prefixes = prefixes or {}
    flags: Flags = {}
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        called = _call_name(node)
        if called == "add_argument":
            name_nodes = node.args
        elif called == "reset_arg" and len(node.args) >= 2:
            name_nodes = node.args[1:2]
        else:
            continue
        names = [name for arg in name_nodes for name in _name_of(arg, prefixes)]
        keywords = {kw.arg: kw.value for kw in node.keywords if kw.arg}
        action_node = keywords.get("action")
        optional_bool = isinstance(action_node, ast.Attribute | ast.Name) and \
            (getattr(action_node, "attr", None) or getattr(action_node, "id", None)) == "BooleanOptionalAction"
        kind = arity(_literal(action_node), _literal(keywords.get("nargs")), optional_bool=optional_bool)
        _add(flags, names, kind, negatable=optional_bool)
    return flags


def prefix_values(trees: Iterable[ast.AST]) -> tuple[str, ...]:
    """The string `prefix=` keywords of calls in `trees` (miles' health checkers: `prefix="trainer-..."`)."""
    found: list[str] = []
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                for kw in node.keywords:
                    value = _literal(kw.value) if kw.arg == "prefix" else None
                    if isinstance(value, str) and value not in found:
                        found.append(value)
    return tuple(found)


# ---------------------------------------------------------------------------------------------------------
# Dataclass-driven flags
# ---------------------------------------------------------------------------------------------------------
ClassFinder = Callable[[str], "ast.ClassDef | None"]


def _field_call(value: ast.AST | None) -> ast.Call | None:
    if isinstance(value, ast.Call) and _call_name(value) == "field":
        return value
    return None


def annotation_is_bool(annotation: ast.AST) -> bool:
    text = ast.unparse(annotation).replace(" ", "")
    return text in ("bool", "Optional[bool]", "bool|None", "None|bool", "typing.Optional[bool]")


def _annotation_is_list(annotation: ast.AST) -> bool:
    text = ast.unparse(annotation).replace(" ", "")
    for wrapper in ("Optional[", "typing.Optional["):
        if text.startswith(wrapper):
            text = text[len(wrapper):]
    return text.startswith(("list[", "List[", "typing.List["))


def dataclass_fields(cls: ast.ClassDef, find: ClassFinder, seen: frozenset[str] = frozenset()) \
        -> list[tuple[str, ast.AnnAssign]]:
    """The (name, declaration) of a dataclass's fields, its bases' first (resolved by name with `find`)."""
    fields: dict[str, ast.AnnAssign] = {}
    for base in cls.bases:
        base_name = base.id if isinstance(base, ast.Name) else base.attr if isinstance(base, ast.Attribute) else ""
        base_cls = find(base_name) if base_name and base_name not in seen else None
        if base_cls is not None:
            fields.update(dataclass_fields(base_cls, find, seen | {cls.name}))
    for statement in cls.body:
        if isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name):
            if "ClassVar" in ast.unparse(statement.annotation) or "InitVar" in ast.unparse(statement.annotation):
                continue
            fields[statement.target.id] = statement
    return list(fields.items())


def megatron_factory_flags(cls: ast.ClassDef, find: ClassFinder, exclude: Iterable[str]) -> Flags:
    """The flags Megatron-LM's `ArgumentGroupFactory(cls, exclude=...)` adds (see the module docstring)."""
    flags: Flags = {}
    excluded = set(exclude)
    for name, declaration in dataclass_fields(cls, find):
        if name in excluded:
            continue
        call = _field_call(declaration.value)
        keywords = {kw.arg: kw.value for kw in call.keywords if kw.arg} if call is not None else {}
        if _literal(keywords.get("init")) is False:
            continue
        default = keywords.get("default") if call is not None else declaration.value
        meta = _argparse_meta(keywords.get("metadata"))
        dashed = name.replace("_", "-")
        if annotation_is_bool(declaration.annotation) and "type" not in meta:
            off_by_default = isinstance(default, ast.Constant) and default.value is False
            names = [f"--{dashed}"] if off_by_default else [f"--no-{dashed}", f"--disable-{dashed}"]
            kind = "switch"
        else:
            names = [f"--{dashed}"]
            kind = "values" if _annotation_is_list(declaration.annotation) else "value"
        if meta:
            meta_names = _literal(meta.get("arg_names"))
            if isinstance(meta_names, list | tuple) and all(isinstance(item, str) for item in meta_names):
                names = list(meta_names)
            if "action" in meta or "nargs" in meta:
                kind = arity(_literal(meta.get("action")), _literal(meta.get("nargs")))
        _add(flags, names, kind)
    return flags


def _argparse_meta(metadata: ast.AST | None) -> dict[str, ast.AST]:
    if not isinstance(metadata, ast.Dict):
        return {}
    for key, value in zip(metadata.keys, metadata.values, strict=True):
        if isinstance(key, ast.Constant) and key.value == "argparse_meta" and isinstance(value, ast.Dict):
            return {k.value: v for k, v in zip(value.keys, value.values, strict=True)
                    if isinstance(k, ast.Constant) and isinstance(k.value, str)}
    return {}


def factory_calls(tree: ast.AST) -> list[tuple[str, list[str]]]:
    """`ArgumentGroupFactory(Class, exclude=...)` calls: (class name, excluded field names); an `exclude`
    given as a variable is resolved from a list assigned to that name anywhere in the module."""
    lists: dict[str, list[str]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            value = _literal(node.value)
            if isinstance(value, list) and all(isinstance(item, str) for item in value):
                lists.setdefault(node.targets[0].id, []).extend(value)
    calls = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and _call_name(node) == "ArgumentGroupFactory" and node.args:
            target = node.args[0]
            name = target.id if isinstance(target, ast.Name) else target.attr if isinstance(target, ast.Attribute) \
                else None
            if name is None:
                continue
            exclude_node = next((kw.value for kw in node.keywords if kw.arg == "exclude"), None)
            excluded = _literal(exclude_node)
            if isinstance(exclude_node, ast.Name):
                excluded = lists.get(exclude_node.id, [])
            calls.append((name, [str(item) for item in excluded] if isinstance(excluded, list) else []))
    return calls


def fsdp_dataclass_flags(tree: ast.AST) -> Flags:
    """miles' FSDP backend: a flag per field of each dataclass whose fields the module turns into flags
    (`dataclasses.fields(X)`), bools as `BooleanOptionalAction` (`--x` and `--no-x`)."""
    targets = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and _call_name(node) == "fields" and node.args \
                and isinstance(node.args[0], ast.Name):
            targets.add(node.args[0].id)
    flags: Flags = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name in targets:
            for name, declaration in dataclass_fields(node, lambda _: None):
                if name == "config":
                    continue
                is_bool = annotation_is_bool(declaration.annotation)
                _add(flags, ["--" + name.replace("_", "-")], "switch" if is_bool else "value", negatable=is_bool)
    return flags


# ---------------------------------------------------------------------------------------------------------
# Megatron-LM as slime and miles run it: their docker/patch/*/megatron*.patch add flags
# ---------------------------------------------------------------------------------------------------------
_PATCH_FLAG = re.compile(r"""add_argument\(\s*((?:['"]--[\w-]+['"]\s*,\s*)*['"]--[\w-]+['"])(.*?)(?=add_argument\(|\Z)""",
                         re.S)
_PATCH_FIELD = re.compile(r"^\s+(\w+)\s*:\s*([\w\[\], |.]+?)\s*=\s*(.+?)\s*$")


def patch_flags(text: str) -> Flags:
    """The flags a unified diff against Megatron-LM adds: `add_argument` calls on its added lines, and fields
    added to a config dataclass that Megatron turns into flags (`transformer_config.py`, by the factory's
    rules). Read with regular expressions: a diff's added lines are not a whole module."""
    flags: Flags = {}
    for section in re.split(r"^diff --git ", text, flags=re.M):
        header, _, body = section.partition("\n")
        added = "\n".join(line[1:] for line in body.splitlines() if line.startswith("+") and not line.startswith("+++"))
        for match in _PATCH_FLAG.finditer(added):
            names = re.findall(r"--[\w-]+", match.group(1))
            rest = match.group(2)[:400]
            action = re.search(r"""action\s*=\s*['"](\w+)['"]""", rest)
            nargs = re.search(r"""nargs\s*=\s*['"]?([+*?\d])""", rest)
            nargs_value: object = nargs.group(1) if nargs else None
            if isinstance(nargs_value, str) and nargs_value.isdigit():
                nargs_value = int(nargs_value)
            _add(flags, names, arity(action.group(1) if action else None, nargs_value))
        if "transformer_config.py" not in header:
            continue
        for line in added.splitlines():
            field_match = _PATCH_FIELD.match(line)
            if not field_match or field_match.group(1).startswith("_"):
                continue
            name, annotation, default = field_match.groups()
            dashed = name.replace("_", "-")
            if annotation.replace(" ", "") in ("bool", "Optional[bool]", "bool|None"):
                _add(flags, [f"--{dashed}"] if default.startswith("False") else [f"--no-{dashed}",
                                                                                    f"--disable-{dashed}"], "switch")
            else:
                _add(flags, [f"--{dashed}"], "values" if annotation.startswith(("list", "List")) else "value")
    return flags
