"""Where a run's trained model lies, said once the run ends: the newest `--save-hf` directory (the model, as
transformers and SGLang load it), else the newest `--save` checkpoint and the `rayless export` command that
makes it one.

Owns `model_hint`. Invariant: it names only what this run saved (never a path it did not write), and its export
command is one a shell takes as printed.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from pathlib import Path

from coordinator.config.checkpoint import save_hf_path
from coordinator.config.settings import Config


def model_hint(config: Config, saved: Sequence[int]) -> str | None:
    """The line that says where the model of the last rollout this run saved lies; None when it saved none."""
    if not saved:
        return None
    last = saved[-1]
    if config.checkpoint.save_hf:
        return (f"the model of rollout {last}: {save_hf_path(config.checkpoint.save_hf, last)} "
                "(a Hugging Face directory: transformers and SGLang load it)")
    if config.checkpoint.save:
        save = config.checkpoint.save
        out = str(Path(save).parent / "model")
        return (f"the checkpoint of rollout {last}: {Path(save) / f'rollout_{last}'}; as a Hugging Face "
                f"directory: rayless export {shlex.quote(save)} {shlex.quote(out)}")
    return None
