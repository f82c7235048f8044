"""The run's logging set-up: the run directory's log file and the terminal, the run's secrets masked in every
record, a user's traceback written to the file alone."""

from __future__ import annotations

import functools
import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from coordinator.config.secrets import SecretMaskFilter, config_secrets
from coordinator.lifecycle.failures import ToFileOnly

if TYPE_CHECKING:
    from coordinator.config import Config


@functools.cache
def stderr_console() -> Any:
    """The one rich console on stderr (the live view and the log handler must share it)."""
    from rich.console import Console

    return Console(stderr=True)


def setup_logging(config: Config, run_dir: Path, *, log_name: str = "coordinator.log") -> None:
    """Log to `<run_dir>/<log_name>` and stderr, the run's secrets masked in every record."""
    run_dir.mkdir(parents=True, exist_ok=True)
    root = logging.getLogger()
    root.setLevel(config.logging.log_level)
    for handler in list(root.handlers):
        root.removeHandler(handler)
    file_handler = logging.FileHandler(run_dir / log_name)
    file_handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    handlers: list[logging.Handler] = [file_handler]
    if sys.stderr.isatty() and not config.logging.no_progress:
        from rich.logging import RichHandler

        handlers.append(RichHandler(console=stderr_console(), show_path=False, log_time_format="%H:%M:%S"))
    else:
        stream = logging.StreamHandler(sys.stderr)
        stream.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s", "%H:%M:%S"))
        handlers.append(stream)
    handlers[1].addFilter(ToFileOnly())  # the terminal: a user's traceback goes to the file alone
    mask = SecretMaskFilter(config_secrets(config))
    for handler in handlers:
        handler.addFilter(mask)
        root.addHandler(handler)
    # one INFO line per request otherwise; "httpx2" is the anthropic SDK's client, which agents use
    for noisy in ("httpx", "httpx2", "httpcore", "aiohttp"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
