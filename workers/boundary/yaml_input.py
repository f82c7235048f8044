"""YAML without anchors or aliases (no "billion laughs"), bounded in size and depth, errors with file:line.

Invariant: `load_yaml` returns plain values built from at most `max_bytes` of text with no alias expansion,
or raises `BoundaryError` naming the file and line; never RecursionError or a yaml traceback.
"""

from __future__ import annotations

from typing import Any

import yaml
from yaml.events import AliasEvent

from workers.boundary.errors import BoundaryError

MAX_YAML_BYTES = 16 << 20
MAX_YAML_DEPTH = 64


class _NoAliasLoader(yaml.SafeLoader):
    """SafeLoader that refuses anchors and aliases, the only way YAML text expands beyond its size."""

    def compose_node(self, parent: Any, index: Any) -> Any:
        event = self.peek_event()
        anchor = getattr(event, "anchor", None)
        if isinstance(event, AliasEvent) or anchor is not None:
            mark = event.start_mark
            raise yaml.MarkedYAMLError(problem="anchors and aliases are not accepted (&/* in YAML)",
                                       problem_mark=mark)
        self._depth = getattr(self, "_depth", 0) + 1
        try:
            if self._depth > MAX_YAML_DEPTH:
                raise yaml.MarkedYAMLError(problem=f"nested deeper than {MAX_YAML_DEPTH} levels",
                                           problem_mark=event.start_mark)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


def load_yaml(text: str | bytes, source: str, max_bytes: int = MAX_YAML_BYTES) -> Any:
    """The YAML document of `source` (a file's path, named in errors with the line)."""
    if len(text) > max_bytes:
        raise BoundaryError(source, f"YAML of {len(text)} bytes is over the limit of {max_bytes}")
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise BoundaryError(source, f"not UTF-8 (byte {exc.start})") from None
    try:
        return yaml.load(text, Loader=_NoAliasLoader)  # a SafeLoader subclass
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"{source}:{mark.line + 1}" if mark is not None else source
        raise BoundaryError(where, exc.problem or "not valid YAML") from None
    except yaml.YAMLError as exc:
        raise BoundaryError(source, f"not valid YAML ({exc})") from None
    except RecursionError:
        raise BoundaryError(source, f"YAML nested deeper than {MAX_YAML_DEPTH} levels") from None
