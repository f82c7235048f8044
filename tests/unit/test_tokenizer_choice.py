"""`coordinator.data.tokenizer` picks the class AutoTokenizer picks and reads the config fields AutoConfig gives,
torch-free; where the files cannot decide, it falls back to the Auto class (asserted per directory)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from coordinator.data import tokenizer as choice

TEXTS = ["hello world", "  a b\tc\n", "<|im_start|>x<|im_end|>", "ünïcode ✓"]
CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "what is 1+1?"},
        {"role": "assistant", "content": "2"}]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "config.json")


def _variant(base: Path, directory: Path, *, tokenizer_class: str | None = "keep",
             model_type: str | None = None, tokenizer_config: dict[str, object] | None = None,
             byte_level: bool = False) -> Path:
    """A copy of `base`'s tokenizer files and config.json with tokenizer_config.json / config.json edited;
    `byte_level`: tokenizer.json's decoder made ByteLevel (a Llama 3 style file, as transformers tells them)."""
    directory.mkdir()
    for name in TOKENIZER_FILES:
        if (base / name).is_file():
            shutil.copy(base / name, directory / name)
    if byte_level:
        spec = json.loads((directory / "tokenizer.json").read_text())
        assert '"ByteLevel"' not in json.dumps(spec)
        spec["decoder"] = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
        (directory / "tokenizer.json").write_text(json.dumps(spec))
    tc = json.loads((directory / "tokenizer_config.json").read_text())
    if tokenizer_class is None:
        tc.pop("tokenizer_class", None)
    elif tokenizer_class != "keep":
        tc["tokenizer_class"] = tokenizer_class
    tc.update(tokenizer_config or {})
    (directory / "tokenizer_config.json").write_text(json.dumps(tc))
    if model_type is not None:
        config = json.loads((directory / "config.json").read_text())
        config["model_type"] = model_type
        (directory / "config.json").write_text(json.dumps(config))
    return directory


# name → whether the files decide the class (True) or the Auto class is used (False)
CASES: dict[str, bool] = {
    "tiny": True, "vlm": True, "Qwen2Tokenizer": True, "Qwen2TokenizerFast": True, "PreTrainedTokenizerFast": True,
    "GPT2Tokenizer": True, "no-class": True, "qwen2-GPT2Tokenizer": True, "qwen2-no-class": True,
    "LlamaTokenizerFast": True, "LlamaTokenizerFast-byte-level": True, "llama-LlamaTokenizerFast": True,
    "llama-byte-level": True, "llama-PreTrainedTokenizerFast": True, "llama-no-class": True,
    "deepseek_v3-byte-level": True, "mistral-byte-level": True, "glm4-PreTrainedTokenizerFast": True,
    "glm4_moe-no-class": True, "qwen3_moe-Qwen2TokenizerFast": True, "qwen3_next-no-class": True,
    "gemma-GemmaTokenizerFast": True, "gemma2-no-class": True,
    "auto_map": False, "unknown-model-type": False, "unknown-class": False,
}
# the Hub's class as the families' checkpoints declare it: (model_type, tokenizer_class, byte-level tokenizer.json)
FAMILIES: dict[str, tuple[str, str | None, bool]] = {
    "LlamaTokenizerFast-byte-level": ("qwen3", "LlamaTokenizerFast", True),
    "llama-LlamaTokenizerFast": ("llama", "LlamaTokenizerFast", False),
    "llama-byte-level": ("llama", "LlamaTokenizerFast", True),
    "llama-PreTrainedTokenizerFast": ("llama", "PreTrainedTokenizerFast", True),
    "llama-no-class": ("llama", None, True),
    "deepseek_v3-byte-level": ("deepseek_v3", "LlamaTokenizerFast", True),
    "mistral-byte-level": ("mistral", "LlamaTokenizerFast", True),
    "glm4-PreTrainedTokenizerFast": ("glm4", "PreTrainedTokenizerFast", False),
    "glm4_moe-no-class": ("glm4_moe", None, False),
    "qwen3_moe-Qwen2TokenizerFast": ("qwen3_moe", "Qwen2TokenizerFast", True),
    "qwen3_next-no-class": ("qwen3_next", None, False),
    "gemma-GemmaTokenizerFast": ("gemma", "GemmaTokenizerFast", False),
    "gemma2-no-class": ("gemma2", None, False),
}


@pytest.fixture(scope="module")
def model_dirs(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from workers.tiny_vlm import build_tiny_vlm

    root = tmp_path_factory.mktemp("tokenizers")
    dirs = {"tiny": tiny_model_dir, "vlm": build_tiny_vlm(root / "vlm")}
    for name in ("Qwen2Tokenizer", "Qwen2TokenizerFast", "PreTrainedTokenizerFast", "GPT2Tokenizer",
                 "LlamaTokenizerFast"):
        dirs[name] = _variant(tiny_model_dir, root / name, tokenizer_class=name)
    dirs["no-class"] = _variant(tiny_model_dir, root / "no-class", tokenizer_class=None)
    # model type qwen2: transformers overrides the Hub's class with the registered one
    dirs["qwen2-GPT2Tokenizer"] = _variant(tiny_model_dir, root / "q2g", tokenizer_class="GPT2Tokenizer",
                                           model_type="qwen2")
    dirs["qwen2-no-class"] = _variant(tiny_model_dir, root / "q2n", tokenizer_class=None, model_type="qwen2")
    dirs["auto_map"] = _variant(tiny_model_dir, root / "auto_map", tokenizer_config={
        "auto_map": {"AutoTokenizer": [None, "tokenization_custom.CustomTokenizer"]}})
    for name, (model_type, cls, byte_level) in FAMILIES.items():
        dirs[name] = _variant(tiny_model_dir, root / name, tokenizer_class=cls, model_type=model_type,
                              byte_level=byte_level)
    dirs["unknown-model-type"] = _variant(tiny_model_dir, root / "olmo2", model_type="olmo2")
    dirs["unknown-class"] = _variant(tiny_model_dir, root / "bert", tokenizer_class="BertTokenizer")
    return dirs


def _auto(directory: Path) -> object:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(directory))


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_class_and_its_output_are_autotokenizers(model_dirs: dict[str, Path], name: str) -> None:
    directory = model_dirs[name]
    if not CASES[name]:
        with pytest.raises(choice._Undecided):
            choice.tokenizer_class(directory)
        assert type(choice.load_tokenizer(directory)) is type(_auto(directory))
        return
    expected = _auto(directory)
    assert choice.tokenizer_class(directory) is type(expected)
    ours = choice.load_tokenizer(directory)
    assert type(ours) is type(expected)
    assert len(ours) == len(expected)  # type: ignore[arg-type]
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == expected.encode(text)  # type: ignore[attr-defined]
        assert ours.decode(ids) == expected.decode(ids)  # type: ignore[attr-defined]
    assert ours.apply_chat_template(CHAT, tokenize=False) == expected.apply_chat_template(  # type: ignore[attr-defined]
        CHAT, tokenize=False)
    assert ours.apply_chat_template(CHAT[:2], tokenize=True, add_generation_prompt=True) == (
        expected.apply_chat_template(CHAT[:2], tokenize=True, add_generation_prompt=True))  # type: ignore[attr-defined]


def test_config_fields_are_autoconfigs(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    from transformers import AutoConfig

    for name in ("tiny", "vlm", "qwen2-no-class"):
        config = AutoConfig.from_pretrained(str(model_dirs[name]))
        vocab = getattr(config, "vocab_size", None) or config.text_config.vocab_size
        assert choice.model_fields(model_dirs[name]) == choice.ModelFields(
            max_position_embeddings=getattr(config, "max_position_embeddings", None), vocab_size=vocab)
    # a field left to the config class's default: AutoConfig decides it (Qwen3Config's 32768), so does the fallback
    bare = _variant(model_dirs["tiny"], tmp_path / "bare")
    config = json.loads((bare / "config.json").read_text())
    del config["max_position_embeddings"]
    (bare / "config.json").write_text(json.dumps(config))
    with pytest.raises(choice._Undecided, match="default"):
        choice.model_fields(bare)
    assert choice.read_model_fields(bare).max_position_embeddings == AutoConfig.from_pretrained(
        str(bare)).max_position_embeddings


def test_decided_loads_import_no_torch(model_dirs: dict[str, Path]) -> None:
    decided = [str(model_dirs[name]) for name, fast in CASES.items() if fast]
    script = ("import json, sys\nfrom coordinator.data.tokenizer import load_tokenizer, read_model_fields\n"
              f"dirs = {decided!r}\n"
              "lengths = [len(load_tokenizer(d)) for d in dirs]\n"
              "fields = [read_model_fields(d).vocab_size for d in dirs[:2]]\n"
              "print(json.dumps([lengths, fields, sorted(m for m in sys.modules if m.split('.')[0] == 'torch')]))\n")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    lengths, fields, torch_modules = json.loads(done.stdout)
    assert len(lengths) == len(decided) and all(n > 0 for n in lengths)
    assert fields == [89, 93]  # the tiny model's vocabulary; the tiny VLM's text_config adds 4 vision tokens
    assert torch_modules == []


def test_the_tables_are_the_installed_transformers_rules() -> None:
    from transformers import CONFIG_MAPPING
    from transformers.models.auto import tokenization_auto as auto

    for model_type, name in choice.MODEL_TYPES.items():
        assert model_type in CONFIG_MAPPING, model_type
        assert auto.TOKENIZER_MAPPING_NAMES.get(model_type) == name, model_type
    assert "olmo2" not in choice.MODEL_TYPES
    assert choice.HUB_CLASS_OVERRIDDEN == set(choice.MODEL_TYPES) & auto.MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS
    assert choice.SPECIAL_MODEL_IDS == tuple(auto.MODEL_IDS_TO_TOKENIZERS_BACKEND)
    for name in choice.CLASSES:
        assert choice._class_named(name) is auto.tokenizer_class_from_name(name), name
    for model_type in choice.MODEL_TYPES:  # nested: no top-level field of their own; the others have both
        defaults = CONFIG_MAPPING[model_type]()
        nested = model_type in choice.NESTED_TEXT_CONFIG
        for field in ("max_position_embeddings", "vocab_size"):
            assert (getattr(defaults, field, None) is None) == nested, (model_type, field)
