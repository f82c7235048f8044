"""The model's tokenizer and the config fields the coordinator reads, loaded without importing torch.

transformers 5 imports torch whenever it is installed as soon as `AutoTokenizer` or `AutoConfig` is touched
(`configuration_utils` → `modeling_rope_utils`), while the tokenizer classes themselves do not. This module owns
the choice AutoTokenizer would make, made from the model directory's files alone.

Invariant: `load_tokenizer(d)` returns an instance of exactly the class `AutoTokenizer.from_pretrained(d)` would
build, loaded by that class's own `from_pretrained` with the same files; `read_model_fields(d)` holds the same
values `AutoConfig.from_pretrained(d)` would give. Where transformers' rules (`models/auto/tokenization_auto.py`
of 5.25) cannot be followed from the files — remote code (`auto_map`), a model type or class name outside the
tables below, a Hub id transformers special-cases, a field the config class defaults — the Auto class is used,
torch is imported, and one log line says so. A Llama-declared tokenizer is decided as transformers decides it: by
whether tokenizer.json holds `"ByteLevel"`. `tests/unit/test_tokenizer_choice.py` holds the tables to the installed transformers and the choice to
AutoTokenizer's.
"""

from __future__ import annotations

import fnmatch
import importlib
import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)

# model_type → the class TOKENIZER_MAPPING_NAMES registers for it (tokenization_auto.py), None for a model type
# whose config transformers knows but that table leaves out (llama, deepseek_v3: the declared class decides, and
# TokenizersBackend without one); model types transformers lists in MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS
# (the registered class wins over the Hub's) in the second table.
MODEL_TYPES: dict[str, str | None] = {
    "qwen2": "Qwen2Tokenizer", "qwen2_moe": "Qwen2Tokenizer", "qwen3": "Qwen2Tokenizer",
    "qwen3_moe": "Qwen2Tokenizer", "qwen3_next": "Qwen2Tokenizer", "qwen2_vl": "Qwen2Tokenizer",
    "qwen2_5_vl": "Qwen2Tokenizer", "qwen3_vl": "Qwen2Tokenizer", "qwen3_vl_moe": "Qwen2Tokenizer",
    "gpt2": "GPT2Tokenizer", "mistral": "TokenizersBackend", "glm4": "TokenizersBackend",
    "glm4_moe": "TokenizersBackend", "gemma": "GemmaTokenizer", "gemma2": "GemmaTokenizer",
    "llama": None, "deepseek_v3": None,
}
HUB_CLASS_OVERRIDDEN: frozenset[str] = frozenset({"qwen2"})
# class name → (module, attribute) that `tokenizer_class_from_name` resolves it to; none of them imports torch
CLASSES: dict[str, tuple[str, str]] = {
    "TokenizersBackend": ("transformers.tokenization_utils_tokenizers", "TokenizersBackend"),
    "PreTrainedTokenizerFast": ("transformers.tokenization_utils_tokenizers", "TokenizersBackend"),
    "Qwen2Tokenizer": ("transformers.models.qwen2.tokenization_qwen2", "Qwen2Tokenizer"),
    "Qwen2TokenizerFast": ("transformers.models.qwen2.tokenization_qwen2", "Qwen2Tokenizer"),
    "GPT2Tokenizer": ("transformers.models.gpt2.tokenization_gpt2", "GPT2Tokenizer"),
    "GPT2TokenizerFast": ("transformers.models.gpt2.tokenization_gpt2", "GPT2Tokenizer"),
    "LlamaTokenizer": ("transformers.models.llama.tokenization_llama", "LlamaTokenizer"),
    "LlamaTokenizerFast": ("transformers.models.llama.tokenization_llama", "LlamaTokenizer"),
    "GemmaTokenizer": ("transformers.models.gemma.tokenization_gemma", "GemmaTokenizer"),
    "GemmaTokenizerFast": ("transformers.models.gemma.tokenization_gemma", "GemmaTokenizer"),
}
# MODEL_IDS_TO_TOKENIZERS_BACKEND: Hub ids whose config transformers does not trust
SPECIAL_MODEL_IDS: tuple[str, ...] = (
    "deepseek-ai/deepseek-r1-distill-llama-*", "deepseek-ai/deepseek-coder-*", "allenai/dolma2-tokenizer",
    "google/umt5-small", "naver-clova-ix/donut-*", "salesforce/blip2-opt-*", "salesforce/blip2-flan-t5-*",
    "salesforce/instructblip-flan-t5-*", "stepfun-ai/step-3.7-*",
)
# the names AutoTokenizer treats as "no specialised class" (its mismatch branch then builds TokenizersBackend)
_GENERIC = ("TokenizersBackend", "PythonBackend", "PreTrainedTokenizerFast", "MistralCommonBackend")
# composite (vision-language) configs: no top-level max_position_embeddings / vocab_size, the text model's in
# text_config
NESTED_TEXT_CONFIG: frozenset[str] = frozenset({"qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe"})


class ModelFields(msgspec.Struct, frozen=True):
    """The config fields the coordinator reads: the context length and the model's vocabulary (its embedding rows;
    a composite config's text model's)."""

    max_position_embeddings: int | None
    vocab_size: int | None


class _Undecided(Exception):
    """The files do not let this module prove AutoTokenizer's / AutoConfig's choice; the reason is its message."""


def _read_json(path: Path) -> dict[str, object] | None:
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise _Undecided(f"{path.name} unreadable ({error})") from None
    if not isinstance(data, dict):
        raise _Undecided(f"{path.name} is not an object")
    return data


def _model_config(model_dir: Path) -> dict[str, object]:
    config = _read_json(model_dir / "config.json")
    if config is None:
        raise _Undecided("no config.json")
    if "auto_map" in config:
        raise _Undecided("config.json names remote code (auto_map)")
    if config.get("model_type") not in MODEL_TYPES:
        raise _Undecided(f"model_type {config.get('model_type')!r} is not in this module's table")
    if "model_name" in config:
        raise _Undecided("config.json sets model_name")
    return config


def _class_named(name: str) -> type:
    if name not in CLASSES:
        raise _Undecided(f"tokenizer class {name!r} is not in this module's table")
    module, attribute = CLASSES[name]
    cls: type = getattr(importlib.import_module(module), attribute)
    return cls


def _byte_level(model_dir: Path) -> bool:
    """transformers' `TokenizersBackend._tokenizer_json_has_byte_level`: the text `"ByteLevel"` in tokenizer.json."""
    try:
        return '"ByteLevel"' in (model_dir / "tokenizer.json").read_text(encoding="utf-8")
    except FileNotFoundError:
        return False
    except (OSError, ValueError) as error:
        raise _Undecided(f"tokenizer.json unreadable ({error})") from None


def tokenizer_class(model_dir: str | Path) -> type:
    """The class AutoTokenizer.from_pretrained(model_dir) builds, decided from the files (transformers 5.25's
    rules, in their order); `_Undecided` where they cannot decide it without transformers' Auto machinery."""
    model_dir = Path(model_dir)
    config = _model_config(model_dir)
    names = (str(model_dir).lower(), str(config.get("_name_or_path", "")).lower())
    if any(fnmatch.fnmatch(name, pattern) for name in names for pattern in SPECIAL_MODEL_IDS):
        raise _Undecided("a Hub id transformers loads as TokenizersBackend by name")
    tokenizer_config = _read_json(model_dir / "tokenizer_config.json") or {}
    if "auto_map" in tokenizer_config:
        raise _Undecided("tokenizer_config.json names remote code (auto_map)")
    declared = tokenizer_config.get("tokenizer_class")
    if declared is not None and not isinstance(declared, str):
        raise _Undecided("tokenizer_class is not a string")
    if declared is None and config.get("tokenizer_class") is not None:
        raise _Undecided("only config.json names the tokenizer class")
    model_type = str(config["model_type"])
    registered = (MODEL_TYPES[model_type] or "TokenizersBackend").removesuffix("Fast")
    if declared is None:  # AutoTokenizer's "be creative" branch: the class registered for the model type
        return _class_named(registered)
    # a Hub "LlamaTokenizer" over a byte-level tokenizer.json (Llama 3 style): LlamaTokenizer hardcodes Metaspace,
    # so transformers loads TokenizersBackend (none of this table's types registers MistralCommonBackend)
    if (declared.removesuffix("Fast") == "LlamaTokenizer" and model_type not in HUB_CLASS_OVERRIDDEN
            and _byte_level(model_dir)):
        return _class_named("TokenizersBackend")
    if MODEL_TYPES[model_type] is None:  # no registered class to disagree with: the declared one
        return _declared(declared)
    if registered != declared.removesuffix("Fast"):  # the Hub's class and the model type's disagree
        if registered not in _GENERIC:
            cls = _class_named(registered if model_type in HUB_CLASS_OVERRIDDEN else declared)
            if cls.__name__ not in ("TokenizersBackend", "PythonBackend", "PreTrainedTokenizerFast"):
                return cls
        return _class_named("TokenizersBackend")
    return _declared(declared)


def _declared(declared: str) -> type:
    """AutoTokenizer's tokenizer_config.json branch: the declared class without "Fast"; the slow base class
    (`PreTrainedTokenizer`, i.e. PythonBackend) is replaced by TokenizersBackend."""
    name = declared.removesuffix("Fast")
    return _class_named("TokenizersBackend" if name in ("PreTrainedTokenizer", "PythonBackend") else name)


def load_tokenizer(model_dir: str | Path, **kwargs: object) -> PreTrainedTokenizerBase:
    """The model's tokenizer, as AutoTokenizer.from_pretrained(model_dir, **kwargs) builds it; torch-free whenever
    the files decide the class (see the module docstring), else through AutoTokenizer (one log line)."""
    try:
        cls = tokenizer_class(model_dir)
    except _Undecided as reason:
        log.info("tokenizer of %s loaded through AutoTokenizer (imports torch): %s", model_dir, reason)
        from transformers import AutoTokenizer

        auto: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(str(model_dir), **kwargs)
        return auto
    tokenizer: PreTrainedTokenizerBase = cls.from_pretrained(str(model_dir), _from_auto=True, **kwargs)  # type: ignore[attr-defined]
    return tokenizer


def _positive_int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def model_fields(model_dir: str | Path) -> ModelFields:
    """`ModelFields` from config.json (raises `_Undecided` where the config class would supply a default)."""
    config = _model_config(Path(model_dir))
    if str(config["model_type"]) in NESTED_TEXT_CONFIG:
        text = config.get("text_config")
        if not isinstance(text, dict):
            raise _Undecided("a composite config without text_config")
        # top-level keys, when present, are set as attributes all the same
        vocab = config.get("vocab_size", text.get("vocab_size"))
        context = config.get("max_position_embeddings")
        if _positive_int(vocab) is None or ("max_position_embeddings" in config and _positive_int(context) is None):
            raise _Undecided("vocab_size / max_position_embeddings not plain integers")
        return ModelFields(max_position_embeddings=_positive_int(context), vocab_size=_positive_int(vocab))
    context, vocab = config.get("max_position_embeddings"), config.get("vocab_size")
    if _positive_int(context) is None or _positive_int(vocab) is None:
        raise _Undecided("config.json leaves max_position_embeddings / vocab_size to the config class's default")
    return ModelFields(max_position_embeddings=_positive_int(context), vocab_size=_positive_int(vocab))


def read_model_fields(model_dir: str | Path) -> ModelFields:
    """The context length and vocabulary AutoConfig.from_pretrained(model_dir) gives; read from config.json when
    it states them, else through AutoConfig (one log line)."""
    try:
        return model_fields(model_dir)
    except _Undecided as reason:
        log.info("config of %s read through AutoConfig (imports torch): %s", model_dir, reason)
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(model_dir))
    vocab = getattr(config, "vocab_size", None) or getattr(getattr(config, "text_config", None), "vocab_size", None)
    return ModelFields(max_position_embeddings=_positive_int(getattr(config, "max_position_embeddings", None)),
                       vocab_size=_positive_int(vocab))
