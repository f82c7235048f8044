"""Where each upstream project declares its flags, read from a git checkout over a range of commits.

Owns `Source` (one project: which files declare flags and how) and `collect`, the union of the flags of every
version of those files between `--since` and the pinned commit, so a flag added and later removed inside the
range is still known (a script of that time may use it). Each file version (blob) is parsed once.

Invariant: only `git` is run (log, ls-tree, cat-file) and only text is read; no upstream code is imported.
"""

from __future__ import annotations

import ast
import fnmatch
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from tools.upstream_flags import extract
from tools.upstream_flags.extract import Flags


def git(git_dir: Path, *args: str) -> str:
    return subprocess.run(["git", f"--git-dir={git_dir}", *args], check=True, capture_output=True,
                          text=True).stdout


@dataclass
class Source:
    """One project's flag-declaring files: `patterns` (fnmatch over repository paths) hold `add_argument`
    calls; `megatron_factory`: also Megatron-LM's dataclass-driven groups; `fsdp_dataclass`: miles' FSDP
    dataclass."""

    name: str
    patterns: tuple[str, ...]
    megatron_factory: bool = False
    class_patterns: tuple[str, ...] = ()
    fsdp_patterns: tuple[str, ...] = ()
    #: unified diffs against Megatron-LM this project applies (its docker images' patches)
    patch_patterns: tuple[str, ...] = ()
    _cache: dict[str, ast.AST | None] = field(default_factory=dict)
    #: flags the patches add (kept apart: their origin is Megatron-LM as this project runs it)
    patched: Flags = field(default_factory=dict)
    _patches: dict[str, Flags] = field(default_factory=dict)
    _listings: dict[str, list[tuple[str, str]]] = field(default_factory=dict)

    def _tree(self, git_dir: Path, sha: str) -> ast.AST | None:
        if sha not in self._cache:
            try:
                self._cache[sha] = ast.parse(git(git_dir, "cat-file", "blob", sha))
            except (SyntaxError, UnicodeDecodeError, subprocess.CalledProcessError):
                self._cache[sha] = None
        return self._cache[sha]

    def _files(self, git_dir: Path, rev: str, patterns: tuple[str, ...]) -> list[tuple[str, str]]:
        if rev not in self._listings:
            listing = []
            for line in git(git_dir, "ls-tree", "-r", rev).splitlines():
                meta, _, path = line.partition("\t")
                parts = meta.split()
                if len(parts) == 3 and parts[1] == "blob" and path.endswith((".py", ".patch")):
                    listing.append((path, parts[2]))
            self._listings = {rev: listing}  # one revision at a time: the listing of a large tree is big
        return [(path, sha) for path, sha in self._listings[rev] if any(fnmatch.fnmatch(path, p) for p in patterns)]

    def revisions(self, git_dir: Path, rev: str, since: str) -> list[str]:
        paths = [p.split("*")[0] or "." for p in self.patterns + self.patch_patterns + self.fsdp_patterns]
        log = git(git_dir, "log", "--format=%H", f"--since={since}", rev, "--", *sorted(set(paths)))
        revs = log.split()
        head = git(git_dir, "rev-parse", rev).strip()
        return revs if head in revs else [head, *revs]

    def flags_at(self, git_dir: Path, rev: str, prefixes: dict[str, tuple[str, ...]]) -> Flags:
        flags: Flags = {}
        trees = [t for _, sha in self._files(git_dir, rev, self.patterns) if (t := self._tree(git_dir, sha))]
        local = dict(prefixes)
        found_prefixes = extract.prefix_values(trees)
        if found_prefixes:
            local.setdefault("prefix", found_prefixes)
        for tree in trees:
            for flag, kind in extract.add_argument_flags(tree, local).items():
                flags.setdefault(flag, kind)
        for _, sha in self._files(git_dir, rev, self.fsdp_patterns):
            tree = self._tree(git_dir, sha)
            if tree is not None:
                for flag, kind in extract.fsdp_dataclass_flags(tree).items():
                    flags.setdefault(flag, kind)
        for _path, sha in self._files(git_dir, rev, self.patch_patterns):
            if sha not in self._patches:
                self._patches[sha] = extract.patch_flags(git(git_dir, "cat-file", "blob", sha))
            self.patched.update(self._patches[sha])
        if self.megatron_factory:
            classes: dict[str, ast.ClassDef] = {}
            for _, sha in self._files(git_dir, rev, self.class_patterns):
                tree = self._tree(git_dir, sha)
                for node in ast.walk(tree) if tree is not None else ():
                    if isinstance(node, ast.ClassDef):
                        classes.setdefault(node.name, node)
            for tree in trees:
                for class_name, exclude in extract.factory_calls(tree):
                    cls = classes.get(class_name)
                    if cls is not None:
                        for flag, kind in extract.megatron_factory_flags(cls, classes.get, exclude).items():
                            flags.setdefault(flag, kind)
        return flags

    def collect(self, git_dir: Path, rev: str, since: str) -> tuple[Flags, list[str]]:
        """The union of the flags over the revisions touching the files since `since`, and those revisions."""
        revs = self.revisions(git_dir, rev, since)
        flags: Flags = {}
        for revision in revs:
            for flag, kind in self.flags_at(git_dir, revision, {}).items():
                flags.setdefault(flag, kind)
        return flags, revs


SLIME = Source("slime", ("slime/utils/arguments.py", "slime/backends/*/arguments.py",
                         "slime/backends/*/*/arguments.py", "slime/rollout/*.py", "slime/rollout/*/*.py",
                         "slime/utils/ft_utils/*.py"),
               fsdp_patterns=("slime/backends/fsdp_utils/arguments.py",),
               patch_patterns=("docker/patch/*/megatron*.patch",))
MILES = Source("miles", ("miles/utils/arguments.py", "miles/backends/*/arguments.py",
                         "miles/rollout/*.py", "miles/rollout/*/*.py", "miles/utils/ft_utils/*.py",
                         "miles/dashboard/args.py"),  # add_dashboard_arguments, called by miles' parser
               fsdp_patterns=("miles/backends/fsdp_utils/arguments.py",),
               patch_patterns=("docker/patch/*/megatron*.patch",))
MEGATRON = Source("megatron", ("megatron/training/arguments.py",), megatron_factory=True,
                  class_patterns=("megatron/training/*.py", "megatron/training/*/*.py", "megatron/core/*.py",
                                  "megatron/core/transformer/*.py", "megatron/core/*/*config*.py"))


def file_flags(path: Path, prefixes: dict[str, tuple[str, ...]]) -> Flags:
    """The `add_argument` flags of one source file (an installed package's module: sglang-router, sglang)."""
    return extract.add_argument_flags(ast.parse(path.read_text(encoding="utf-8")), prefixes)


def router_flags(path: Path) -> Flags:
    """sglang-router's `RouterArgs.add_cli_args(parser, use_router_prefix=True, exclude_host_port=True)`, as
    slime and miles call it: every flag under the `router-` prefix (host and port excluded)."""
    flags = file_flags(path, {"prefix": ("router-",)})
    return {flag: kind for flag, kind in flags.items() if flag not in ("--host", "--port")}


def sglang_flags(path: Path, skipped: tuple[str, ...]) -> Flags:
    """SGLang's `ServerArgs.add_cli_args` as slime adds it: each flag under `--sglang-`, minus slime's
    `skipped_args` (arguments rayless/slime set themselves)."""
    flags: Flags = {}
    tree = ast.parse(path.read_text(encoding="utf-8"))
    declared = dict(extract.add_argument_flags(tree, {}))
    # SGLang 0.5.2x declares most server flags as annotated fields (`name: A[T, help]`) of the namespaces in
    # srt/arg_groups/fields/, which `add_cli_args_from_dataclass` turns into `--name`
    for module in sorted((path.parent / "arg_groups" / "fields").glob("*.py")):
        for node in ast.walk(ast.parse(module.read_text(encoding="utf-8"))):
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) \
                    and ast.unparse(node.annotation).startswith("A[") and not node.target.id.startswith("_"):
                is_bool = ast.unparse(node.annotation).startswith(("A[bool", "A[Optional[bool]", "A[bool | None"))
                declared.setdefault("--" + node.target.id.replace("_", "-"), "switch" if is_bool else "value")
    for flag, kind in declared.items():
        if flag[2:].replace("-", "_") in skipped:
            continue
        flags["--sglang-" + flag[2:]] = kind
    return flags


def slime_sglang_skipped(git_dir: Path, rev: str) -> tuple[str, ...]:
    """slime's `skipped_args`: the SGLang server arguments its parser does not add under `--sglang-`."""
    text = git(git_dir, "show", f"{rev}:slime/backends/sglang_utils/arguments.py")
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "skipped_args"
                                                for t in node.targets):
            value = ast.literal_eval(node.value)
            return tuple(str(item) for item in value)
    return ()
