"""Secrets on the command line and in files: which values are secret, and masking them wherever text goes.

Owns the masking rules: a value is secret when it belongs to a flag declared `secret` (`--sglang-api-key`,
`--wandb-key`) or to any flag whose name looks secret (`*-key`, `*-token`, `*secret*`, `*password*`; see
`fields.looks_secret`), whether the flag is ours, passed through to SGLang, or unknown. Invariant: such a value
appears in no message we print or log and in no file we write; `MASK` stands in for it. A secret learnt at
run time (a multi-node control token) joins the log filters through `mask_in_logs`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from coordinator.config.fields import looks_secret

if TYPE_CHECKING:
    from collections.abc import Mapping

    from coordinator.config.sglang import SglangConfig

MASK = "***"


def is_secret_flag(flag: str) -> bool:
    """Whether the value of `--flag` is secret: as declared for our flags, by its name for any other."""
    from coordinator.config.flags import FLAGS

    name = flag.lstrip("-").replace("-", "_")
    if name in FLAGS:
        return FLAGS[name][1].secret
    return looks_secret(name)


def secret_values_in_argv(argv: Sequence[str]) -> set[str]:
    """Values given to secret-looking flags on a command line (`--x-key V` and `--x-key=V`)."""
    found: set[str] = set()
    for index, token in enumerate(argv):
        if not token.startswith("--"):
            continue
        name, equals, value = token.partition("=")
        if not is_secret_flag(name):
            continue
        if equals:
            found.add(value)
        elif index + 1 < len(argv) and not argv[index + 1].startswith("--"):
            found.add(argv[index + 1])
    return {value for value in found if value}


def split_secret_flags(argv: Sequence[str]) -> tuple[list[str], dict[str, str]]:
    """`argv` without its secret-looking flags, and those flags' values by name (without the dashes): what a
    launch hands a child in a file instead (`--x-key V` and `--x-key=V`; a bare switch is kept)."""
    public: list[str] = []
    found: dict[str, str] = {}
    index = 0
    while index < len(argv):
        token = argv[index]
        name, equals, value = token.partition("=")
        if token.startswith("--") and is_secret_flag(name):
            if equals:
                found[name[2:]] = value
                index += 1
                continue
            if index + 1 < len(argv) and not argv[index + 1].startswith("--"):
                found[name[2:]] = argv[index + 1]
                index += 2
                continue
        public.append(token)
        index += 1
    return public, found


def mask_argv(tokens: Sequence[str]) -> list[str]:
    """A command line (ours, an engine's, the `--sglang-*` passthrough) with the values of secret-looking flags
    masked."""
    masked: list[str] = []
    hide_next = False
    for token in tokens:
        name, equals, _ = token.partition("=")
        if hide_next and not token.startswith("--"):
            masked.append(MASK)
        elif equals and token.startswith("--") and is_secret_flag(name):
            masked.append(f"{name}={MASK}")
        else:
            masked.append(token)
        hide_next = token.startswith("--") and not equals and is_secret_flag(name)
    return masked


class FlatConfig(Protocol):
    """What masking reads of a Config (`coordinator.config.settings.Config`): its flat view and the sglang slice."""

    @property
    def sglang(self) -> SglangConfig: ...

    def flat(self) -> Mapping[str, Any]: ...


def config_secrets(config: FlatConfig) -> set[str]:
    """The secret values of a Config: its secret flags' values and those of secret-looking passthrough flags."""
    from coordinator.config.flags import FLAGS

    flat = config.flat()
    found = {str(value) for name, value in flat.items() if FLAGS[name][1].secret and value}
    found |= secret_values_in_argv(config.sglang.sglang_passthrough)
    return found


def mask_text(text: str, secrets: Iterable[str]) -> str:
    """`text` with every occurrence of every secret replaced by MASK (longest first)."""
    for secret in sorted(set(secrets), key=len, reverse=True):
        if secret:
            text = text.replace(secret, MASK)
    return text


class SecretMaskFilter(logging.Filter):
    """A logging filter that masks the run's secrets in every record it passes (message and arguments)."""

    def __init__(self, secrets: Iterable[str]) -> None:
        super().__init__()
        self.secrets = sorted({secret for secret in secrets if secret}, key=len, reverse=True)

    def filter(self, record: logging.LogRecord) -> bool:
        if self.secrets:
            record.msg = mask_text(record.getMessage(), self.secrets)
            record.args = None
            if record.exc_info and record.exc_info[1] is not None and not record.exc_text:
                record.exc_text = mask_text(logging.Formatter().formatException(record.exc_info), self.secrets)
        return True



def mask_in_logs(secret: str) -> None:
    """Mask `secret` from now on in every record the root logger's handlers pass (a secret learnt at run time,
    such as a control token read from a file)."""
    for handler in logging.getLogger().handlers:
        for existing in handler.filters:
            if isinstance(existing, SecretMaskFilter) and secret and secret not in existing.secrets:
                existing.secrets = sorted({*existing.secrets, secret}, key=len, reverse=True)
