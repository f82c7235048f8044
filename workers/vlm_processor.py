"""A vision-language model's processing, shared by the coordinator, the engine and the ranks: images to the
vision tower's inputs, the prompt's image placeholders expanded, and the multimodal rotary positions.

Owns the one rule by which a prompt with images becomes token ids: each `<|image_pad|>` of the rendered prompt
(one per `{"type": "image"}` part, as Qwen2-VL's chat template writes it) is repeated `t*h*w / merge**2` times for
its image's grid, as Qwen2-VL's processor and SGLang's do. The coordinator keeps those expanded ids as the
sample's prompt, the engine checks a request's ids against them and the trainer feeds them back with the same
`pixel_values`, so all three see one sequence.

Invariant: `expand_ids(ids, grid)` has exactly `image_tokens(grid)` image tokens per image, or raises
VlmInputError; nothing here reads a file or the network (images arrive decoded, bounded by
`workers.boundary.images`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from workers.errors import RaylessError

if TYPE_CHECKING:
    import torch
    from PIL.Image import Image

#: Model families whose processing this module reproduces (config.json's model_type).
VLM_MODEL_TYPES = frozenset({"qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe"})


class VlmInputError(RaylessError, ValueError):
    """Images that do not fit the prompt (count or placeholder tokens), or a model this module cannot serve."""


def vlm_model_type(model_path: str | Path) -> str | None:
    """The model's family when it is a vision-language model this module serves, else None (read from its
    config.json; a directory without one is not a VLM here)."""
    import json

    config = Path(model_path) / "config.json"
    try:
        model_type = json.loads(config.read_text(encoding="utf-8")).get("model_type")
    except (OSError, ValueError):
        return None
    return model_type if model_type in VLM_MODEL_TYPES else None


@dataclass(frozen=True)
class PixelInputs:
    """The vision tower's inputs for a sample's images, in prompt order."""

    pixel_values: torch.Tensor  # float32 [patches, channels * temporal * patch * patch]
    image_grid_thw: torch.Tensor  # int64 [images, 3]


class VlmProcessor:
    """A model directory's tokenizer and image processor, and its vision token ids."""

    def __init__(self, model_path: str | Path) -> None:
        import json

        from transformers import AutoImageProcessor, AutoTokenizer

        path = Path(model_path)
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
        if config.get("model_type") not in VLM_MODEL_TYPES:
            raise VlmInputError(f"{path}: model_type {config.get('model_type')!r} is not a vision-language model "
                                f"rayless serves (it serves {', '.join(sorted(VLM_MODEL_TYPES))})")
        self.tokenizer = AutoTokenizer.from_pretrained(str(path))
        self.image_processor = AutoImageProcessor.from_pretrained(str(path))
        self.image_token_id = int(config["image_token_id"])
        self.merge_size = int(getattr(self.image_processor, "merge_size", 2))

    def pixel_inputs(self, images: Sequence[Image]) -> PixelInputs:
        import torch

        out = self.image_processor(images=list(images), return_tensors="pt")
        return PixelInputs(pixel_values=out["pixel_values"].to(torch.float32),
                           image_grid_thw=out["image_grid_thw"].to(torch.int64))

    def __call__(self, text: str | Sequence[str] | None = None, images: Sequence[Image] | None = None,
                 videos: object = None, return_tensors: str | None = None, **_: object) -> dict[str, object]:
        """A transformers processor's call, as slime's hooks make it (`processor(text=..., images=...)`, one
        text): the ids with each `<|image_pad|>` expanded for its image, `attention_mask`, and the images'
        `pixel_values` / `image_grid_thw` as tensors; ids as lists unless `return_tensors="pt"`."""
        import torch

        if videos:
            raise VlmInputError("videos: rayless serves images only")
        texts = [text] if isinstance(text, str) else list(text or [""])
        if len(texts) != 1:
            raise VlmInputError(f"the processor takes one text per call here; got {len(texts)}")
        ids = list(self.tokenizer(texts[0], add_special_tokens=False)["input_ids"])
        out: dict[str, object] = {}
        if images:
            pixels = self.pixel_inputs(images)
            ids = self.expand_ids(ids, pixels.image_grid_thw)
            out = {"pixel_values": pixels.pixel_values, "image_grid_thw": pixels.image_grid_thw}
        else:
            self.expand_ids(ids, torch.zeros((0, 3), dtype=torch.int64))  # placeholders without images: refused
        rows, mask = [ids], [[1] * len(ids)]
        if return_tensors == "pt":
            return {"input_ids": torch.tensor(rows), "attention_mask": torch.tensor(mask), **out}
        return {"input_ids": rows, "attention_mask": mask, **out}

    def image_tokens(self, grid_thw: Sequence[int]) -> int:
        t, h, w = (int(v) for v in grid_thw)
        return t * h * w // (self.merge_size ** 2)

    def expand_ids(self, ids: Sequence[int], image_grid_thw: torch.Tensor) -> list[int]:
        """`ids` with each single image token repeated for its image's grid (the rendered prompt's ids)."""
        grids = [list(map(int, row)) for row in image_grid_thw.tolist()]
        placeholders = sum(1 for token in ids if token == self.image_token_id)
        if placeholders != len(grids):
            raise VlmInputError(f"the prompt has {placeholders} image placeholder(s) for {len(grids)} image(s)")
        out: list[int] = []
        images = iter(grids)
        for token in ids:
            if token == self.image_token_id:
                out.extend([token] * self.image_tokens(next(images)))
            else:
                out.append(int(token))
        return out

    def expand_with_mask(self, ids: Sequence[int], mask: Sequence[int], image_grid_thw: torch.Tensor
                         ) -> tuple[list[int], list[int]]:
        """`expand_ids`, and a per-token mask beside the ids expanded with them (an image token's copies take its
        entry: an SFT chat's loss mask)."""
        expanded = self.expand_ids(ids, image_grid_thw)
        grids = iter(image_grid_thw.tolist())
        out: list[int] = []
        for token, value in zip(ids, mask, strict=True):
            out.extend([int(value)] * (self.image_tokens(next(grids)) if token == self.image_token_id else 1))
        return expanded, out

    def check_expanded(self, ids: Sequence[int], image_grid_thw: torch.Tensor) -> None:
        """Raise unless `ids` hold exactly the image tokens the images' grids take (an engine's request)."""
        want = sum(self.image_tokens(row) for row in image_grid_thw.tolist())
        have = sum(1 for token in ids if token == self.image_token_id)
        if have != want:
            raise VlmInputError(f"the input ids hold {have} image token(s); the {len(image_grid_thw)} image(s) "
                                f"take {want}")


def image_token_mask(ids: torch.Tensor, image_token_id: int) -> torch.Tensor:
    return ids == image_token_id


def rope_positions(model: torch.nn.Module, input_ids: torch.Tensor, image_grid_thw: torch.Tensor,
                   image_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen2-VL's multimodal rotary positions for one row `input_ids` [1, L]: ([3, 1, L], the row's delta: a
    later token at index i has position i + delta on all three axes), from the model's own `get_rope_index`."""
    import torch

    # the module that holds it, under whatever wraps the model (FSDP2 keeps the class, PEFT nests it)
    owner = next((module for module in model.modules() if hasattr(module, "get_rope_index")), None)
    if owner is None:
        raise VlmInputError(f"{type(model).__name__} has no get_rope_index: not a Qwen-VL-family model")
    kinds = (input_ids == image_token_id).to(torch.int32)
    with torch.no_grad():
        positions, deltas = owner.get_rope_index(input_ids, mm_token_type_ids=kinds,
                                                 image_grid_thw=image_grid_thw.to(input_ids.device))
    return positions, deltas
