"""The control token of a multi-node run: one secret every node holds, never on a command line or in a log.

Owns where the token comes from, in this order:

1. `--control-token-file PATH` on a filesystem every node shares: node 0 creates it when absent — a fresh
   32-byte hex token written to a temporary file of mode 0600 in the same directory, then hard-linked into
   place, so no node ever reads half a token and an existing file is never replaced — and every node reads it,
   waiting for it to appear (node k may start before node 0). A file that is not a regular file owned by this
   user, or that group or others may read or write, is refused.
2. `RAYLESS_CONTROL_TOKEN` in the environment the launcher propagates to every node (srun exports the
   submitting environment by default; `export RAYLESS_CONTROL_TOKEN=$(openssl rand -hex 32)` in the sbatch
   script). It is the variable the ranks read too.

Invariants: the value is returned to the caller and nowhere else — `describe()` and every error name the
source, never the value; a token of fewer than `MIN_TOKEN_CHARS` characters or with whitespace is refused.
"""

from __future__ import annotations

import os
import secrets
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import anyio

from coordinator.config.fields import ConfigError
from workers import protocol
from workers.errors import RaylessError

if TYPE_CHECKING:
    from coordinator.config.settings import Config

ENV_TOKEN = protocol.ENV_TOKEN
MIN_TOKEN_CHARS = 16
POLL_S = 0.5


class ControlTokenError(RaylessError, RuntimeError):
    """The token could not be read or created (the message names the file or variable, never the value)."""


@dataclass(frozen=True)
class TokenSource:
    """Where this run's control token comes from: a file, the environment, or (a dry run only) nowhere."""

    kind: str  # "file" | "env" | "missing"
    path: str | None = None
    #: the environment's token (kept out of repr)
    value: str | None = field(default=None, repr=False)

    def describe(self) -> str:
        if self.kind == "file":
            return f"from --control-token-file {self.path} (mode 0600; node 0 creates it when absent)"
        if self.kind == "env":
            return f"from {ENV_TOKEN} in every node's environment"
        return f"none: set {ENV_TOKEN} in the launcher's environment, or give --control-token-file"

    async def obtain(self, *, create: bool, timeout_s: float = 300.0) -> str:
        """The token. From a file: node 0 (`create`) creates it when absent; the others wait up to `timeout_s`
        for it to appear."""
        if self.kind == "env" and self.value is not None:
            return self.value
        if self.kind != "file" or self.path is None:
            raise ControlTokenError(f"no control token: {self.describe()}")
        path = Path(self.path)
        if create:
            return await anyio.to_thread.run_sync(create_or_read_token_file, path)
        with anyio.move_on_after(timeout_s):
            while True:
                token = await anyio.to_thread.run_sync(read_token_file, path)
                if token is not None:
                    return token
                await anyio.sleep(POLL_S)
        raise ControlTokenError(f"--control-token-file {path}: node 0 did not create it within {timeout_s:.0f} s "
                                "(is the directory on a filesystem node 0 shares, and is node 0 running?)")


def token_source(config: Config, env: Mapping[str, str], *, lenient: bool = False) -> tuple[TokenSource, list[str]]:
    """The run's token source, checked as far as can be before launch (ConfigError, or a warning when lenient)."""
    path = config.cluster.control_token_file
    try:
        if path is not None:
            directory = Path(path).parent
            if not directory.is_dir():
                raise ConfigError(f"--control-token-file {path}: directory {directory} does not exist (it must be "
                                  "on a filesystem every node shares)")
            read_token_file(Path(path), error=ConfigError)
            return TokenSource("file", path=path), []
        value = env.get(ENV_TOKEN)
        if value is not None:
            check_token(value, f"{ENV_TOKEN} (from the environment)", error=ConfigError)
            return TokenSource("env", value=value), []
        raise ConfigError(f"--actor-num-nodes {config.cluster.actor_num_nodes}: every node needs the control "
                          f"token: set {ENV_TOKEN} in the launcher's environment (e.g. export {ENV_TOKEN}=$(openssl "
                          "rand -hex 32) before srun), or give --control-token-file PATH on a shared filesystem")
    except ConfigError as error:
        if not lenient:
            raise
        return TokenSource("missing"), [str(error)]


def check_token(token: str, where: str, *, error: type[Exception] = ControlTokenError) -> str:
    if len(token) < MIN_TOKEN_CHARS or len(token) > protocol.MAX_TOKEN_CHARS or any(c.isspace() for c in token):
        raise error(f"{where}: a control token must be {MIN_TOKEN_CHARS} to {protocol.MAX_TOKEN_CHARS} characters "
                    "without whitespace (e.g. openssl rand -hex 32)")
    return token


def read_token_file(path: Path, *, error: type[Exception] = ControlTokenError) -> str | None:
    """The token in `path`, or None when there is no such file yet; `error` for a file that must not be trusted."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise error(f"--control-token-file {path}: cannot be opened: {exc.strerror or exc}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise error(f"--control-token-file {path}: not a regular file")
        if info.st_uid != os.getuid():
            raise error(f"--control-token-file {path}: owned by uid {info.st_uid}, not by this user ({os.getuid()})")
        if info.st_mode & 0o077:
            raise error(f"--control-token-file {path}: mode {stat.S_IMODE(info.st_mode):04o} lets others read or "
                        "write it; it must be 0600 (chmod 600, or delete it and let node 0 create it)")
        data = b""
        while chunk := os.read(fd, 4096):
            data += chunk
            if len(data) > protocol.MAX_TOKEN_CHARS + 2:
                break
    finally:
        os.close(fd)
    try:
        text = data.decode("ascii").strip()
    except UnicodeDecodeError:
        raise error(f"--control-token-file {path}: not an ASCII token") from None
    return check_token(text, f"--control-token-file {path}", error=error)


def create_or_read_token_file(path: Path) -> str:
    """Node 0: the token in `path`, creating the file (0600, atomically, never replacing one) when absent."""
    existing = read_token_file(path)
    if existing is not None:
        return existing
    token = secrets.token_hex(32)
    temporary = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.write(fd, (token + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.link(temporary, path)  # fails if the file appeared meanwhile: read that one instead
    except FileExistsError:
        pass
    finally:
        os.unlink(temporary)
    found = read_token_file(path)
    if found is None:
        raise ControlTokenError(f"--control-token-file {path}: vanished right after it was created")
    return found
