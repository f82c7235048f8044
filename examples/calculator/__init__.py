"""A tool-using task the tiny model learns on CPU: call a calculator, then copy its result (docs/hooks.md)."""
