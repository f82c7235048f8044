"""`rayless export CKPT OUT`: a checkpoint rayless wrote, as a Hugging Face model directory, on the CPU.

Owns the offline path from a checkpoint (`--save`'s save dir or one `rollout_<id>` of it: a full model's DCP
shards, an SFT run's, or a LoRA run's adapters) to the directory `--save-hf` writes during a run. It rebuilds
the model the ranks trained — the base model the checkpoint records in `extra.json` (or `--hf-checkpoint`),
the checkpoint's adapters injected — loads the checkpoint's weights through the ranks' own reader
(`checkpoint.load_model_weights`) and writes through the ranks' own exporter (`weight_export`), so the
directory holds exactly what an engine would have been sent: full weights, LoRA merged, tied aliases dropped,
the adapter in PEFT format in `adapter/` beside them.

Invariants: no engine, no process group, no GPU; bad input (a path that holds no checkpoint, no base model to
rebuild, an output that cannot be written) is one line naming the file and exit 2, before any weight is read;
OUT appears only complete.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from workers.errors import RaylessError

DESCRIPTION = """Write a checkpoint rayless saved (--save: a save dir or one rollout_<id> of it; full, SFT or LoRA)
as a Hugging Face model directory that transformers and SGLang load: config and tokenizer files, the weights
(merged for LoRA, whose adapter goes in OUT/adapter/). Runs on the CPU; starts no engine."""


class ExportError(RaylessError, ValueError):
    """Bad input to `rayless export`: the message names the file and what to do."""


@dataclass(frozen=True)
class ExportSource:
    """What a checkpoint needs to become a model: its directory, its rollout, the base model and dtype it was
    trained from, and its LoRA adapters' record (None: it holds the full model)."""

    checkpoint: Path
    rollout_id: int
    base_model: Path
    dtype: str
    adapters: dict[str, Any] | None


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="rayless export", description=DESCRIPTION)
    parser.add_argument("checkpoint", metavar="CKPT", help="a --save directory (its latest checkpoint) or a "
                        "rollout_<id> directory in it")
    parser.add_argument("out", metavar="OUT", help="the Hugging Face directory to write (replaced when it is an "
                        "earlier export or empty)")
    parser.add_argument("--hf-checkpoint", metavar="DIR", default=None,
                        help="the model the run started from (default: the one the checkpoint records)")
    return parser.parse_args(list(argv))


def resolve_source(checkpoint: str | Path, *, hf_checkpoint: str | None = None) -> ExportSource:
    """The checkpoint directory and what rebuilds its model, or ExportError naming the file at fault."""
    from workers.train_rank.checkpoint import CheckpointError, resolve_checkpoint

    try:
        directory = resolve_checkpoint(checkpoint)
    except (CheckpointError, OSError) as error:
        raise ExportError(f"rayless export: {checkpoint}: no rayless checkpoint there ({error})") from None
    extra_file = directory / "extra.json"
    try:
        meta = json.loads(extra_file.read_text())
        rollout_id = int(meta["rollout_id"])
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ExportError(f"rayless export: {extra_file}: unreadable ({error})") from None
    recorded = meta.get("base_model") if isinstance(meta.get("base_model"), dict) else {}
    adapters = meta.get("lora") if isinstance(meta.get("lora"), dict) else None
    base = hf_checkpoint or recorded.get("hf_checkpoint")
    if base is None:
        raise ExportError(f"rayless export: {extra_file} records no base model (a checkpoint of an older rayless): "
                          "pass --hf-checkpoint DIR, the model the run started from")
    if not (Path(base) / "config.json").is_file():
        where = f"--hf-checkpoint {base}" if hf_checkpoint else f"{base} (the base model {extra_file} records)"
        raise ExportError(f"rayless export: {where}: not a Hugging Face model directory (no config.json)"
                          + ("" if hf_checkpoint else "; pass --hf-checkpoint DIR if it has moved"))
    dtype = str(recorded.get("dtype") or "float32")
    return ExportSource(checkpoint=directory, rollout_id=rollout_id, base_model=Path(base), dtype=dtype,
                        adapters=adapters)


def check_output(out: str | Path, source: ExportSource) -> Path:
    """OUT can be written: new, empty or an earlier export, and never the base model itself."""
    path = Path(out).absolute()
    if path.resolve() == source.base_model.absolute().resolve():
        raise ExportError(f"rayless export: OUT {out}: the base model itself; name another directory")
    if path.exists() and not path.is_dir():
        raise ExportError(f"rayless export: OUT {out}: exists and is not a directory")
    if path.is_dir() and any(path.iterdir()) and not (path / "config.json").is_file():
        raise ExportError(f"rayless export: OUT {out}: exists, is not empty and is not a Hugging Face model "
                          "directory (no config.json); name a new directory")
    return path


def export_checkpoint(source: ExportSource, out: Path) -> Path:
    """Rebuild the trained model on the CPU, load the checkpoint into it, write OUT (see the module doc)."""
    import msgspec
    import torch

    from workers.protocol.train_settings import LoraSettings
    from workers.train_rank import checkpoint, lora, weight_export
    from workers.train_rank.model import load_causal_lm

    model = load_causal_lm(str(source.base_model), dtype=getattr(torch, source.dtype), device=torch.device("cpu"),
                           trainable=False)
    spec = msgspec.convert(source.adapters, LoraSettings) if source.adapters is not None else None
    if spec is not None:
        lora.inject_lora(model, spec)
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        checkpoint.load_model_weights(source.checkpoint, model)
    except (CheckpointException, RuntimeError, ValueError, KeyError) as error:
        # DCP wraps the cause with each rank's traceback: its last line says what did not fit
        why = ([line for line in str(error).splitlines() if line.strip()] or [type(error).__name__])[-1].strip()
        raise ExportError(f"rayless export: {source.checkpoint}: its weights do not fit the model of "
                          f"{source.base_model} ({why[:300]}); pass --hf-checkpoint DIR, the model the run "
                          "started from") from None
    state = weight_export.full_state_dict(model, sharded=False)
    adapter = lora.adapter_state(model) if spec is not None else None

    def write_adapter(directory: Path) -> None:
        if adapter is not None and spec is not None:
            lora.write_adapter_files(adapter, spec, directory / lora.ADAPTER_DIR,
                                     base_model_path=str(source.base_model.absolute()))

    return weight_export.write_hf_directory(state, source_dir=source.base_model, directory=out,
                                            write_extra=write_adapter)


def main(argv: Sequence[str]) -> int:
    options = parse_args(argv)
    try:
        source = resolve_source(options.checkpoint, hf_checkpoint=options.hf_checkpoint)
        out = check_output(options.out, source)
    except ExportError as error:
        print(error, file=sys.stderr)
        return 2
    import warnings

    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()  # one line on success, not a bar per load
    with warnings.catch_warnings():
        # DCP warns that it runs without a process group: this is one process, on purpose
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        try:
            path = export_checkpoint(source, out)
        except ExportError as error:
            print(error, file=sys.stderr)
            return 2
    kind = "merged LoRA adapters, the adapter in adapter/" if source.adapters is not None else "the full model"
    print(f"wrote {path} from {source.checkpoint} (rollout {source.rollout_id}, {kind}); load it with "
          "transformers' from_pretrained or serve it: python -m sglang.launch_server --model-path " + str(path))
    return 0
