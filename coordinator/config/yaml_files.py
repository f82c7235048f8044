"""The YAML of `--config`, `--eval-config` and `--custom-config-path`, read through the boundary layer.

Owns the one way a config file's YAML is loaded. Invariant: anchors and aliases (a "billion laughs" expands
from them) are refused before anything is built, nesting and size are bounded, and every refusal is one
`ConfigError` naming the file and line (`FILE:LINE: reason`), never a yaml traceback.
"""

from __future__ import annotations

from typing import Any

from coordinator.config.fields import ConfigError
from workers.boundary.errors import BoundaryError
from workers.boundary.yaml_input import load_yaml

#: what the boundary's loader refuses in YAML that parses; its other refusals are syntax errors
_REFUSALS = ("anchors and aliases", "nested deeper", "over the limit", "not UTF-8", "not valid YAML")


def load_config_yaml(text: str | bytes, source: str) -> Any:
    """The document of `source` (the flag and the file, as messages name it)."""
    try:
        return load_yaml(text, source)
    except BoundaryError as error:
        if any(marker in error.reason for marker in _REFUSALS):
            raise ConfigError(str(error)) from None
        raise ConfigError(f"{error.source}: not valid YAML: {error.reason}") from None
