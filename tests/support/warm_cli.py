"""A warm `rayless train`: one server process imports what the CLI's checks import, then forks one child per
request that runs the real entry point (`coordinator.cli.main`) on its own argv, cwd and module path.

Why: the CLI's tokenizer check imports transformers, and transformers imports torch (~3 CPU-seconds, against
~0.5 s for everything else a dry run does). The launch-script test validates 40-odd scripts; paying that import
once instead of once per script takes about two minutes off the suite on two cores. Each child is a process
of its own, forked before any run: it imports its hooks itself, and nothing one child does reaches another.

Invariant: the server imports neither `coordinator.run` nor any user module, so a child starts from the state
`rayless train` has after its imports; the server exits when its stdin closes.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]

_SERVER = textwrap.dedent("""
    import io, json, os, sys, traceback
    import transformers.models.auto.tokenization_auto  # the import this server exists to pay once
    import coordinator.cli

    def run_child(request):
        os.chdir(request["cwd"])
        for name in request["unset"]:
            os.environ.pop(name, None)
        os.environ.update(request["env"])
        sys.path[0:0] = request["path"]
        for fd, name in ((1, request["stdout"]), (2, request["stderr"])):
            target = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            os.dup2(target, fd)
            os.close(target)
        sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), encoding="utf-8", line_buffering=True)
        sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), encoding="utf-8", line_buffering=True)
        try:
            code = coordinator.cli.main(request["argv"])
        except SystemExit as stop:
            code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        except BaseException:
            traceback.print_exc()
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
        import psutil
        with open(request["facts"], "w") as facts:  # what the dry-run tests check of the process itself
            json.dump({"children": len(psutil.Process().children(recursive=True)),
                       "launcher_imported": "coordinator.run" in sys.modules}, facts)
        os._exit(code or 0)

    for line in sys.stdin:
        request = json.loads(line)
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:
            run_child(request)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"code": os.waitstatus_to_exitcode(status)}), flush=True)
""")


@dataclass
class WarmCli:
    """The server process; `run` is one `rayless ARGV` in a fresh child. Close it (or use `with`)."""

    scratch: Path
    process: subprocess.Popen[str] | None = field(default=None, init=False)
    runs: int = field(default=0, init=False)

    def __enter__(self) -> WarmCli:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
        self.process = subprocess.Popen([sys.executable, "-c", _SERVER], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.process is None:
            return
        assert self.process.stdin is not None
        self.process.stdin.close()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        finally:
            if self.process.stdout is not None:
                self.process.stdout.close()

    def run(self, argv: list[str], *, cwd: Path, python_path: list[Path] = (), env: dict[str, str] | None = None,
            unset: tuple[str, ...] = (), timeout: float = 120.0) -> tuple[int, str, str]:
        """(exit status, stdout, stderr) of `rayless ARGV` run in `cwd` with `python_path` first on the path,
        `env` added to this process's environment and `unset` taken out of it."""
        outcome = self.run_probed(argv, cwd=cwd, python_path=python_path, env=env, unset=unset, timeout=timeout)
        return outcome["status"], outcome["stdout"], outcome["stderr"]

    def run_probed(self, argv: list[str], *, cwd: Path, python_path: list[Path] = (),
                   env: dict[str, str] | None = None, unset: tuple[str, ...] = (),
                   timeout: float = 120.0) -> dict[str, Any]:
        """`run`, as a dict (status, stdout, stderr) with what the child saw of itself once `main` returned:
        `children` (its live child processes) and `launcher_imported` (whether `coordinator.run` was imported)."""
        assert self.process is not None and self.process.stdin is not None and self.process.stdout is not None
        self.runs += 1
        out, err = self.scratch / f"run-{self.runs}.out", self.scratch / f"run-{self.runs}.err"
        facts = self.scratch / f"run-{self.runs}.json"
        path = [str(p) for p in python_path]
        merged_env = {"PYTHONPATH": os.pathsep.join([*path, str(ROOT), os.environ.get("PYTHONPATH", "")]),
                      **(env or {})}
        request = {"argv": argv, "cwd": str(cwd), "path": path, "env": merged_env, "unset": list(unset),
                   "stdout": str(out), "stderr": str(err), "facts": str(facts)}
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        ready, _, _ = select.select([self.process.stdout], [], [], timeout)
        if not ready:
            self.process.kill()
            raise TimeoutError(f"rayless {' '.join(argv[:3])} ...: no exit within {timeout} s")
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"the warm CLI server ended (exit {self.process.wait()})")
        seen = json.loads(facts.read_text()) if facts.exists() else {}
        return {"status": json.loads(line)["code"], "stdout": out.read_text(), "stderr": err.read_text(), **seen}
