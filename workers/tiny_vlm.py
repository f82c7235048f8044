"""Builds a tiny Qwen2.5-VL-family model directory locally (`rayless make-tiny-model --vlm`): nothing from a hub.

Owns the default vision-language model of the built-in VLM task and of the VLM tests: a two-layer vision tower
(patch 14, 2x2 merge) in front of a two-layer language model over the tiny model's character vocabulary plus
Qwen2-VL's vision tokens (`<|vision_start|>`, `<|image_pad|>`, `<|vision_end|>`, `<|video_pad|>`), and a processor
made without the Hub: the character tokenizer, Qwen2-VL's PIL image processor with small pixel bounds (an image
becomes at most `max_pixels / 28**2` placeholder tokens), and a chat template that renders `{"type": "image"}`
content parts as Qwen2-VL's does (`<|vision_start|><|image_pad|><|vision_end|>`, without its default system
turn, so prompts stay short). `AutoModelForImageTextToText`, `AutoProcessor` and `AutoTokenizer` load the
directory offline.

Invariant: the same seed gives byte-identical weights, and the text ids are the tiny text model's (the vision
tokens come after them), so text-only data tokenizes the same for both models.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from workers.tiny_model import EOS_TOKEN, PAD_TOKEN, build_tokenizer_files, seeded, vocabulary

VISION_START = "<|vision_start|>"
IMAGE_PAD = "<|image_pad|>"
VISION_END = "<|vision_end|>"
VIDEO_PAD = "<|video_pad|>"
VISION_TOKENS = (VISION_START, IMAGE_PAD, VISION_END, VIDEO_PAD)

# Qwen2-VL's template, content parts rendered in order; an image part is its three vision tokens, which the
# processor expands to one `<|image_pad|>` per merged patch.
VLM_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

PATCH_SIZE = 14
MERGE_SIZE = 2
TEMPORAL_PATCH_SIZE = 2
PIXEL_FACTOR = PATCH_SIZE * MERGE_SIZE  # one placeholder token per 28x28 pixels


@dataclass(frozen=True)
class TinyVlmSpec:
    hidden_size: int = 64
    num_hidden_layers: int = 2
    intermediate_size: int = 128
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    vision_hidden_size: int = 32
    vision_depth: int = 2
    vision_heads: int = 2
    max_position_embeddings: int = 1024
    #: the image processor's bounds: an image is resized to between these many pixels (multiples of 28x28)
    min_pixels: int = 2 * 2 * PIXEL_FACTOR**2
    max_pixels: int = 4 * 4 * PIXEL_FACTOR**2
    seed: int = 0


def build_tiny_vlm(directory: str | Path, spec: TinyVlmSpec | None = None) -> Path:
    """Write the model directory (weights, config, tokenizer, processor) and return its path."""
    import torch
    from transformers import GenerationConfig, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    spec = spec or TinyVlmSpec()
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    vocab = vocabulary((), VISION_TOKENS)
    head_dim = spec.hidden_size // spec.num_attention_heads
    half = head_dim // 2  # mrope splits the rotary half over (temporal, height, width)
    section = [half - 2 * (half // 3), half // 3, half // 3]
    config = Qwen2_5_VLConfig(
        text_config={
            "vocab_size": len(vocab), "hidden_size": spec.hidden_size,
            "intermediate_size": spec.intermediate_size, "num_hidden_layers": spec.num_hidden_layers,
            "num_attention_heads": spec.num_attention_heads, "num_key_value_heads": spec.num_key_value_heads,
            "max_position_embeddings": spec.max_position_embeddings,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": section},
            "tie_word_embeddings": True, "pad_token_id": vocab[PAD_TOKEN], "eos_token_id": vocab[EOS_TOKEN],
            "bos_token_id": None,
        },
        vision_config={
            "depth": spec.vision_depth, "hidden_size": spec.vision_hidden_size,
            "intermediate_size": 2 * spec.vision_hidden_size, "num_heads": spec.vision_heads,
            "out_hidden_size": spec.hidden_size, "patch_size": PATCH_SIZE, "spatial_merge_size": MERGE_SIZE,
            "temporal_patch_size": TEMPORAL_PATCH_SIZE, "window_size": 4 * PIXEL_FACTOR,
            "fullatt_block_indexes": [spec.vision_depth - 1],
        },
        image_token_id=vocab[IMAGE_PAD], video_token_id=vocab[VIDEO_PAD],
        vision_start_token_id=vocab[VISION_START], vision_end_token_id=vocab[VISION_END],
        tie_word_embeddings=True,
    )
    with seeded(spec.seed):
        model = Qwen2_5_VLForConditionalGeneration._from_config(config, dtype=torch.float32)
    model.save_pretrained(str(directory), safe_serialization=True)
    GenerationConfig(eos_token_id=vocab[EOS_TOKEN], pad_token_id=vocab[PAD_TOKEN]).save_pretrained(str(directory))
    build_tokenizer_files(directory, (), spec.max_position_embeddings, specials=VISION_TOKENS,
                          chat_template=VLM_CHAT_TEMPLATE)
    build_processor_files(directory, spec)
    (directory / "rayless_tiny_model.json").write_text(json.dumps({"vlm": True, **asdict(spec)}, indent=2) + "\n")
    return directory


def build_processor_files(directory: Path, spec: TinyVlmSpec) -> None:
    """Qwen2-VL's PIL image processor (no torchvision) with the spec's pixel bounds, saved beside the tokenizer so
    `AutoImageProcessor.from_pretrained(directory)` rebuilds it (`workers.vlm_processor` joins the two)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    image_processor = Qwen2VLImageProcessorPil(
        size={"shortest_edge": spec.min_pixels, "longest_edge": spec.max_pixels},
        patch_size=PATCH_SIZE, merge_size=MERGE_SIZE, temporal_patch_size=TEMPORAL_PATCH_SIZE,
    )
    image_processor.save_pretrained(str(directory))
