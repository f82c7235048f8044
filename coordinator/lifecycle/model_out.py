"""Where a run's trained model lies, said once the run ends: the newest `--save-hf` directory (the model, as
transformers and SGLang load it), else the newest `--save` checkpoint and the `rayless export` command that
makes it one.

Owns `model_hint`. Invariant: it names only what this run saved (never a path it did not write), its paths are
absolute (`./run.sh` runs the job from the repository, wherever its caller's shell is), and its export command
is one a shell takes as printed, from any directory.
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
        return (f"the model of rollout {last}: {Path(save_hf_path(config.checkpoint.save_hf, last)).absolute()} "
                "(a Hugging Face directory: transformers and SGLang load it)")
    if config.checkpoint.save:
        save = Path(config.checkpoint.save).absolute()
        return (f"the checkpoint of rollout {last}: {save / f'rollout_{last}'}; as a Hugging Face directory: "
                f"rayless export {shlex.quote(str(save))} {shlex.quote(str(save.parent / 'model'))}")
    return None
