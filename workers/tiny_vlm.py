"""Builds a tiny Qwen-VL-family model directory locally (`rayless make-tiny-model --vlm [--vlm-family F]`):
nothing from a hub.

Owns the vision-language models of the built-in VLM task and of the VLM tests, one per family (`FAMILIES`):
Qwen2.5-VL (the default), Qwen2-VL and Qwen3-VL. Each is a two-layer vision tower (2x2 merge; patch 14, or 16
for Qwen3-VL, whose tower also feeds its first decoder layer "deepstack" features) in front of a two-layer
language model over the tiny model's character vocabulary plus the family's vision tokens (`<|vision_start|>`,
`<|image_pad|>`, `<|vision_end|>`, `<|video_pad|>`, the same four in all three), and a processor made without
the Hub: the character tokenizer, Qwen2-VL's PIL image processor with small pixel bounds (an image becomes 4 to
16 placeholder tokens; Qwen3-VL's checkpoints use the same processor with patch 16 and mean/std 0.5), and a
chat template that renders `{"type": "image"}` content parts as the family's does
(`<|vision_start|><|image_pad|><|vision_end|>`, without a default system turn, so prompts stay short).
`AutoModelForImageTextToText`, `AutoImageProcessor` and `AutoTokenizer` load the directory offline.

Invariant: the same seed gives byte-identical weights, and the text ids are the tiny text model's (the vision
tokens come after them), so text-only data tokenizes the same for both models.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from workers.tiny_model import EOS_TOKEN, PAD_TOKEN, build_tokenizer_files, seeded, vocabulary

if TYPE_CHECKING:
    from transformers import PretrainedConfig

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

#: `--vlm-family` values (config.json's model_type); the first is `--vlm`'s default
FAMILIES = ("qwen2_5_vl", "qwen2_vl", "qwen3_vl", "qwen3_vl_moe")
#: each family's vision patch size (Qwen3-VL's checkpoints: 16; Qwen2-VL's and Qwen2.5-VL's: 14)
PATCH_SIZES = {"qwen2_5_vl": PATCH_SIZE, "qwen2_vl": PATCH_SIZE, "qwen3_vl": 16, "qwen3_vl_moe": 16}
#: the families with Qwen3-VL's tower, positions and normalisation (the MoE differs in its language model only)
QWEN3_FAMILIES = frozenset({"qwen3_vl", "qwen3_vl_moe"})


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
    #: the image processor's bounds: an image is resized to between these many pixels (sides multiples of
    #: `pixel_factor`); None: 2x2 (at most 4x4) merged patches, so an image becomes 4 to 16 placeholder tokens
    min_pixels: int | None = None
    max_pixels: int | None = None
    seed: int = 0
    family: str = FAMILIES[0]

    @property
    def pixel_factor(self) -> int:
        """An image's sides are resized to multiples of this (one placeholder token per factor x factor)."""
        return PATCH_SIZES[self.family] * MERGE_SIZE

    def pixel_bounds(self) -> tuple[int, int]:
        factor = self.pixel_factor
        return (self.min_pixels if self.min_pixels is not None else 2 * 2 * factor**2,
                self.max_pixels if self.max_pixels is not None else 4 * 4 * factor**2)


def build_tiny_vlm(directory: str | Path, spec: TinyVlmSpec | None = None) -> Path:
    """Write the model directory (weights, config, tokenizer, processor) and return its path."""
    import torch
    from transformers import AutoModelForImageTextToText, GenerationConfig

    spec = spec or TinyVlmSpec()
    if spec.family not in FAMILIES:
        raise ValueError(f"family {spec.family!r} is not one of {', '.join(FAMILIES)}")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    vocab = vocabulary((), VISION_TOKENS)
    config = _config(spec, vocab)
    with seeded(spec.seed):
        model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    model.save_pretrained(str(directory), safe_serialization=True)
    GenerationConfig(eos_token_id=vocab[EOS_TOKEN], pad_token_id=vocab[PAD_TOKEN]).save_pretrained(str(directory))
    build_tokenizer_files(directory, (), spec.max_position_embeddings, specials=VISION_TOKENS,
                          chat_template=VLM_CHAT_TEMPLATE)
    build_processor_files(directory, spec)
    (directory / "rayless_tiny_model.json").write_text(json.dumps({"vlm": True, **asdict(spec)}, indent=2) + "\n")
    return directory


def _config(spec: TinyVlmSpec, vocab: dict[str, int]) -> PretrainedConfig:
    """The family's config at the spec's shape: the same language model (mrope over the rotary half, split
    (temporal, height, width)) and vision tokens for all three; each family's own vision tower."""
    from transformers import Qwen2_5_VLConfig, Qwen2VLConfig, Qwen3VLConfig, Qwen3VLMoeConfig

    head_dim = spec.hidden_size // spec.num_attention_heads
    half = head_dim // 2
    section = [half - 2 * (half // 3), half // 3, half // 3]
    rope: dict[str, object] = {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": section}
    qwen3 = spec.family in QWEN3_FAMILIES
    if qwen3:
        rope["mrope_interleaved"] = True  # Qwen3-VL's checkpoints interleave the three axes' frequencies
    text = {
        "vocab_size": len(vocab), "hidden_size": spec.hidden_size, "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_hidden_layers, "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_key_value_heads, "max_position_embeddings": spec.max_position_embeddings,
        "rope_parameters": rope, "tie_word_embeddings": True, "pad_token_id": vocab[PAD_TOKEN],
        "eos_token_id": vocab[EOS_TOKEN], "bos_token_id": None,
    }
    tokens = {"image_token_id": vocab[IMAGE_PAD], "video_token_id": vocab[VIDEO_PAD],
              "vision_start_token_id": vocab[VISION_START], "vision_end_token_id": vocab[VISION_END]}
    tower = {"depth": spec.vision_depth, "num_heads": spec.vision_heads, "spatial_merge_size": MERGE_SIZE,
             "patch_size": PATCH_SIZES[spec.family], "temporal_patch_size": TEMPORAL_PATCH_SIZE}
    if spec.family == "qwen2_vl":
        return Qwen2VLConfig(text_config=text, vision_config={
            **tower, "embed_dim": spec.vision_hidden_size, "mlp_ratio": 2, "hidden_size": spec.hidden_size,
        }, **tokens, tie_word_embeddings=True)
    if qwen3:
        vision = {
            **tower, "hidden_size": spec.vision_hidden_size, "intermediate_size": 2 * spec.vision_hidden_size,
            "out_hidden_size": spec.hidden_size,
            # learned position embeddings on an 8x8 grid, interpolated to each image's patches
            "num_position_embeddings": 64,
            # the first tower block's merged features are added to the first decoder layer's image tokens
            "deepstack_visual_indexes": [0],
        }
        if spec.family == "qwen3_vl":
            return Qwen3VLConfig(text_config={**text, "head_dim": head_dim}, vision_config=vision, **tokens,
                                 tie_word_embeddings=True)
        # Qwen3-VL-30B-A3B's shape in small: every decoder layer a sparse MoE block, top-2 of 4 experts
        experts = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": spec.intermediate_size // 2,
                   "decoder_sparse_step": 1, "mlp_only_layers": []}
        return Qwen3VLMoeConfig(text_config={**text, "head_dim": head_dim, **experts}, vision_config=vision,
                                **tokens, tie_word_embeddings=True)
    return Qwen2_5_VLConfig(text_config=text, vision_config={
        **tower, "hidden_size": spec.vision_hidden_size, "intermediate_size": 2 * spec.vision_hidden_size,
        "out_hidden_size": spec.hidden_size, "window_size": 4 * PIXEL_FACTOR,
        "fullatt_block_indexes": [spec.vision_depth - 1],
    }, **tokens, tie_word_embeddings=True)


def build_processor_files(directory: Path, spec: TinyVlmSpec) -> None:
    """Qwen2-VL's PIL image processor (no torchvision) with the spec's pixel bounds, saved beside the tokenizer so
    `AutoImageProcessor.from_pretrained(directory)` rebuilds it (`workers.vlm_processor` joins the two)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    low, high = spec.pixel_bounds()
    # Qwen3-VL's checkpoints normalize with mean = std = 0.5; Qwen2-VL's and Qwen2.5-VL's with CLIP's (the default)
    normal = {"image_mean": [0.5] * 3, "image_std": [0.5] * 3} if spec.family in QWEN3_FAMILIES else {}
    image_processor = Qwen2VLImageProcessorPil(
        size={"shortest_edge": low, "longest_edge": high}, **normal,
        patch_size=PATCH_SIZES[spec.family], merge_size=MERGE_SIZE, temporal_patch_size=TEMPORAL_PATCH_SIZE,
    )
    image_processor.save_pretrained(str(directory))
