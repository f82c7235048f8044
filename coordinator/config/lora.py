"""The LoRA slice: miles' `--lora-*` flags and `--target-modules`, and the adapters they resolve to.

Owns these flags and `rank_lora`, the one mapping from them to the ranks' `lora` setting
(`workers.train_rank.lora.LoraSpec`). Names, defaults and start-up rules are miles' (`add_lora_arguments` and
its checks in `miles/utils/arguments.py`): LoRA is on with `--lora-rank > 0` or `--lora-adapter-path`;
`--target-modules` is then required: `all-linear` (the seven attention/MLP projections, plus the MLA ones
when the model's config has `kv_lora_rank` / `q_lora_rank`) or a comma-separated list of Hugging Face or
Megatron names (`linear_qkv` → q_proj,k_proj,v_proj, ...), minus `--exclude-modules`.

Invariant: the engines never see an adapter. They are sent the merged weights by every transfer mode, so
the flags that steer SGLang's LoRA serving are accepted with no effect (`--lora-sync-from-tensor`,
`--lora-base-cpu-backup`) or refused when they would change what is trained or served
(`--lora-train-only`, `--experts-shared-outer-loras`).
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from coordinator.config.fields import ConfigError, ConfigWarning, Slice, flag
from workers.protocol.train_settings import LoraSettings

ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ALL_NAMES = ("all", "all-linear", "all_linear")  # miles' convert_target_modules_to_megatron
#: Megatron module names (miles' standard and canonical LoRA, and the MLA ones) → the Hugging Face modules
MEGATRON_TO_HF: dict[str, tuple[str, ...]] = {
    "linear_qkv": ("q_proj", "k_proj", "v_proj"), "linear_proj": ("o_proj",),
    "linear_fc1": ("gate_proj", "up_proj"), "linear_fc2": ("down_proj",),
    "linear_q": ("q_proj",), "linear_k": ("k_proj",), "linear_v": ("v_proj",),
    "linear_fc1_gate": ("gate_proj",), "linear_fc1_up": ("up_proj",),
    "linear_q_down_proj": ("q_a_proj",), "linear_kv_down_proj": ("kv_a_proj_with_mqa",),
    "linear_q_up_proj": ("q_b_proj",), "linear_kv_up_proj": ("kv_b_proj",),
}


@dataclass(frozen=True)
class LoraConfig(Slice):
    TITLE = "lora"
    DESCRIPTION = "LoRA adapters trained instead of the full model (peft); engines get the merged weights"

    lora_rank: int = flag(0, help="LoRA rank: train rank-r adapters on --target-modules instead of the full "
                          "model (0: LoRA off)", minimum=0)
    lora_alpha: int = flag(16, help="LoRA alpha: the adapters' output is scaled by alpha / rank", minimum=1)
    lora_dropout: float = flag(0.0, help="dropout on the adapters' input while training", minimum=0, maximum=1)
    lora_type: str = flag("lora", help="miles' adapter layout; on Hugging Face modules every targeted Linear "
                          "gets its own adapter either way (q/k/v split, as canonical_lora)",
                          choices=("lora", "canonical_lora"))
    target_modules: str | None = flag(None, help="modules to adapt: all-linear, or comma-separated Hugging Face "
                                      "(q_proj,v_proj) or Megatron (linear_qkv,linear_proj) names; required with "
                                      "--lora-rank", metavar="MODULES")
    exclude_modules: str | None = flag(None, help="comma-separated modules to leave out of --target-modules",
                                       metavar="MODULES")
    lora_adapter_path: str | None = flag(None, help="start from this pre-trained adapter (Hugging Face PEFT "
                                         "directory: adapter_config.json + adapter_model.safetensors)",
                                         metavar="DIR")
    lora_sync_from_tensor: bool = flag(False, help="miles: sync the adapter by tensor, not file. No effect: the "
                                       "engines get merged weights by --update-weight-transfer-mode")
    lora_base_cpu_backup: bool = flag(False, help="miles: SGLang-side CPU copy of the base weights under "
                                      "--colocate. No effect: the engines hold a plain model")
    lora_train_only: bool = flag(False, help="miles: keep the engines on the frozen base policy. Refused: the "
                                 "engines here always serve the trained (merged) policy")
    experts_shared_outer_loras: bool = flag(False, help="miles: grouped-expert MoE LoRA layout. Refused: not "
                                            "supported")

    @property
    def enabled(self) -> bool:
        """miles' `is_lora_enabled`."""
        return self.lora_rank > 0 or self.lora_adapter_path is not None

    def check(self) -> None:
        if self.lora_rank > 0 and self.target_modules is None:
            raise ConfigError("'--target-modules' is required when LoRA is enabled (--lora-rank > 0): all-linear "
                              "or a comma-separated list such as q_proj,v_proj")
        if self.lora_dropout >= 1:
            raise ConfigError(f"--lora-dropout must be < 1, got {self.lora_dropout}")
        if self.lora_train_only:
            raise ConfigError("--lora-train-only keeps miles' engines on the base policy because they cannot serve "
                              "the adapter; rayless engines always get the merged weights: drop the flag")
        if self.experts_shared_outer_loras:
            raise ConfigError("--experts-shared-outer-loras (grouped-expert MoE LoRA) is not supported: drop it")
        if self.target_modules is not None and not _split(self.target_modules):
            raise ConfigError("--target-modules: no module named")
        idle = [name for name, given in (("--lora-sync-from-tensor", self.lora_sync_from_tensor),
                                         ("--lora-base-cpu-backup", self.lora_base_cpu_backup)) if given]
        if idle:
            warnings.warn(f"{' / '.join(idle)}: no effect here: the engines get the merged weights by "
                          "--update-weight-transfer-mode and hold a plain model", ConfigWarning, stacklevel=3)
        if not self.enabled and (self.target_modules is not None or self.exclude_modules is not None):
            warnings.warn("--target-modules / --exclude-modules have no effect without --lora-rank (LoRA is off)",
                          ConfigWarning, stacklevel=3)

    def resolved_targets(self, hf_checkpoint: str) -> tuple[str, ...]:
        """The Hugging Face leaf names to adapt (miles' rules), `--exclude-modules` removed."""
        raw = self.target_modules
        if raw is None:  # --lora-adapter-path alone: the adapter's own targets
            saved = _adapter_config(self.lora_adapter_path).get("target_modules") or []
            raw = saved if isinstance(saved, str) else ",".join(str(name) for name in saved)
        names = _split(raw)
        if len(names) == 1 and names[0] in ALL_NAMES:
            modules = list(ALL_LINEAR)
            model_config = _read_json(Path(hf_checkpoint) / "config.json", "--hf-checkpoint")
            text = model_config.get("text_config") or model_config
            if text.get("kv_lora_rank"):
                modules += ["kv_a_proj_with_mqa", "kv_b_proj"]
                if text.get("q_lora_rank"):
                    modules += ["q_a_proj", "q_b_proj"]
        else:
            modules = _to_hf(names)
        excluded = set(_to_hf(_split(self.exclude_modules or "")))
        targets = tuple(m for m in modules if m not in excluded)
        if not targets:
            raise ConfigError(f"--exclude-modules {self.exclude_modules} leaves none of --target-modules {raw}")
        return targets

    def rank_lora(self, hf_checkpoint: str) -> LoraSettings | None:
        """The ranks' `lora` setting (None: full fine-tuning)."""
        if not self.enabled:
            return None
        rank, alpha = self.lora_rank, float(self.lora_alpha)
        if self.lora_adapter_path is not None:
            adapter = _adapter_config(self.lora_adapter_path)
            saved = int(adapter.get("r") or 0)
            if rank and saved and rank != saved:
                raise ConfigError(f"--lora-rank {rank} differs from the rank {saved} of --lora-adapter-path "
                                  f"{self.lora_adapter_path}")
            rank = rank or saved
            if self.lora_rank == 0 and adapter.get("lora_alpha") is not None:
                alpha = float(adapter["lora_alpha"])
            if rank < 1:
                raise ConfigError(f"--lora-adapter-path {self.lora_adapter_path}: its adapter_config.json gives "
                                  "no rank 'r': pass --lora-rank")
        return LoraSettings(rank=rank, alpha=alpha, dropout=self.lora_dropout,
                            target_modules=tuple(self.resolved_targets(hf_checkpoint)),
                            adapter_path=self.lora_adapter_path)


def _split(value: str) -> list[str]:
    return [part.strip() for part in value.split(",") if part.strip()]


def _to_hf(names: list[str]) -> list[str]:
    """Megatron names mapped to Hugging Face ones, order kept, each once."""
    out: list[str] = []
    for name in names:
        for module in MEGATRON_TO_HF.get(name, (name,)):
            if module not in out:
                out.append(module)
    return out


def _read_json(path: Path, flag_name: str) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise ConfigError(f"{flag_name}: cannot read {path}: {error}") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{flag_name}: {path} is not a JSON object")
    return value


def _adapter_config(path: str | None) -> dict[str, Any]:
    return _read_json(Path(str(path)) / "adapter_config.json", "--lora-adapter-path")
