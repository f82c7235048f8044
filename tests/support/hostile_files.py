"""Hostile config files the boundary tests share: the YAML "billion laughs"."""

from __future__ import annotations


def laughs(levels: int = 9) -> str:
    """The classic "billion laughs": 9 levels of 9 aliases each, ~340 bytes expanding to 9**9 strings."""
    lines = ['a0: &a0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"
