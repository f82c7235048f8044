"""Builds a complete, tiny Hugging Face model directory locally: nothing is fetched from a hub.

Owns the default model of the default job and of the tests: a Qwen3-family decoder over a character
vocabulary (digits, letters, a little punctuation, and the chat/eos specials). The directory holds
config.json, model.safetensors, generation_config.json and tokenizer files written with `tokenizers`, so
`AutoModelForCausalLM.from_pretrained(DIR)` and `AutoTokenizer.from_pretrained(DIR)` load it offline.

`TinyModelSpec.words` adds whole words as single tokens after the characters (tool tags such as `<search>`, so a
random tiny model writes a tool call now and then); without them the vocabulary and weights are unchanged.
`TinyModelSpec.untied_head` gives the model an output head of its own (a copy of the embeddings), so LoRA can
adapt it.

Invariant: the same seed and sizes give byte-identical weights, so runs and tests are reproducible.
"""

from __future__ import annotations

import json
import string
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

PAD_TOKEN = "<|pad|>"
UNK_TOKEN = "<|unk|>"
EOS_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [PAD_TOKEN, UNK_TOKEN, EOS_TOKEN, IM_START, IM_END]
CHARACTERS = string.digits + " +-=*/()[]{}.,:;!?\\'\"\n" + string.ascii_lowercase + string.ascii_uppercase

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@dataclass(frozen=True)
class TinyModelSpec:
    hidden_size: int = 64
    num_hidden_layers: int = 2
    intermediate_size: int = 128
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 512
    seed: int = 0
    #: Whole words that are one token each (after the characters).
    words: tuple[str, ...] = ()
    #: The model's vocabulary when larger than the tokenizer's (e.g. Qwen3's 151,936): rows no text maps to,
    #: as real checkpoints pad theirs; None: the tokenizer's size.
    vocab_size: int | None = None
    #: Per attention head (Qwen3-0.6B: 128 with hidden 1024 and 16 heads); None: hidden_size // heads.
    head_dim: int | None = None
    #: An output head of its own (`tie_word_embeddings` false), starting as a copy of the embeddings: the same
    #: model's outputs, with a head LoRA can adapt (docs/lora.md).
    untied_head: bool = False


def vocabulary(words: tuple[str, ...] = (), specials: tuple[str, ...] = ()) -> dict[str, int]:
    """The character vocabulary; `specials` (the tiny VLM's vision tokens) come last, so the text model's ids
    are unchanged by them."""
    tokens = list(dict.fromkeys(SPECIAL_TOKENS + list(CHARACTERS) + list(words) + list(specials)))
    return {token: index for index, token in enumerate(tokens)}


def build_tokenizer_files(directory: Path, words: tuple[str, ...] = (),
                          max_length: int = TinyModelSpec.max_position_embeddings, *,
                          specials: tuple[str, ...] = (), chat_template: str = CHAT_TEMPLATE) -> None:
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = vocabulary(words, specials)
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK_TOKEN))
    # One token per character: split every character off, keep it, and join them back when decoding.
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens([AddedToken(token, special=True, normalized=False)
                                for token in SPECIAL_TOKENS + list(specials)])
    if words:  # matched whole before the per-character split
        backend.add_tokens([AddedToken(word, special=False, normalized=False) for word in words])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD_TOKEN,
        unk_token=UNK_TOKEN,
        eos_token=EOS_TOKEN,
        bos_token=None,
        model_max_length=max_length,
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(str(directory))


def build_tiny_model(directory: str | Path, spec: TinyModelSpec | None = None) -> Path:
    """Write the model directory and return its path. Existing files in it are overwritten."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig, Qwen3Config

    spec = spec or TinyModelSpec()
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    vocab = vocabulary(spec.words)
    vocab_size = max(len(vocab), spec.vocab_size or 0)
    config = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        head_dim=spec.head_dim or spec.hidden_size // spec.num_attention_heads,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=True,
        pad_token_id=vocab[PAD_TOKEN],
        eos_token_id=vocab[EOS_TOKEN],
        bos_token_id=None,
        torch_dtype="float32",
        use_cache=True,
    )
    with seeded(spec.seed):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if spec.untied_head:  # untied after the seeded build, so every other weight is the tied model's
        model.config.tie_word_embeddings = False
        model.lm_head.weight = torch.nn.Parameter(model.model.embed_tokens.weight.detach().clone())
    model.save_pretrained(str(directory), safe_serialization=True)
    GenerationConfig(eos_token_id=vocab[EOS_TOKEN], pad_token_id=vocab[PAD_TOKEN]).save_pretrained(str(directory))
    build_tokenizer_files(directory, spec.words, spec.max_position_embeddings)
    (directory / "rayless_tiny_model.json").write_text(json.dumps(spec.__dict__, indent=2) + "\n")
    return directory


def count_parameters(directory: str | Path) -> int:
    from safetensors import safe_open

    total = 0
    with safe_open(str(Path(directory) / "model.safetensors"), framework="pt") as handle:
        for name in handle.keys():
            total += _product(handle.get_slice(name).get_shape())
    return total


def _product(shape: list[int]) -> int:
    result = 1
    for size in shape:
        result *= size
    return result


@contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Torch's global generator seeded for a model's random weights, then given back as it was: building a
    tiny model leaves the caller's random stream untouched."""
    import torch

    state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        yield
    finally:
        torch.random.set_rng_state(state)
