"""`python -m workers.engine ...`: the CPU engine's process entry point."""

from __future__ import annotations

from workers.engine import main

if __name__ == "__main__":
    raise SystemExit(main())
