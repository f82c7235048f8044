"""A packed micro-batch's images: the vision tower's inputs and Qwen2-VL's multimodal positions, for a rank
training a vision-language model (`workers.vlm_processor`).

Owns `attach_vision`. The samples stay packed: the row's position ids become transformers' packed multimodal
form [4, 1, L] — row 0 the text positions restarting at 0 per sample (attention stays within each sample, as
for text, through `packed_attention`), rows 1-3 each sample's (temporal, height, width) rotary positions from
the model's own `get_rope_index` (a text-only sample: its text positions on all three) — and the samples'
`pixel_values` / `image_grid_thw` are concatenated in row order, which is the order the model scatters image
features into the row's image tokens.

Invariants: every sample's image tokens match its images' grids, or BatchError; the loss mask is zero at every
position that scores an image token (a prompt's always are; an environment's image in a later turn too).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from workers.protocol import WireSample
from workers.train_rank.batching import BatchError, MicroBatch
from workers.vlm_processor import rope_positions


def attach_vision(batch: MicroBatch, samples: Sequence[WireSample], model: torch.nn.Module,
                  image_token_id: int, merge_size: int) -> None:
    """Give a packed `batch` of `samples` its images and multimodal positions. A row without images takes the
    multimodal form too: given plain [1, L] position ids, the model attends across the row's samples (its
    logprobs measured 0.1 off a sample's own forward)."""
    assert batch.position_ids is not None and batch.input_ids.shape[0] == 1, "attach_vision takes a packed row"
    rows, pixels, grids = [], [], []
    if not samples:  # an empty micro-batch (a rank given no sample, or a padded count): its padding row as text
        rows.append(torch.arange(batch.input_ids.shape[1]).view(1, 1, -1).expand(3, 1, -1))
    for index, sample in enumerate(samples):
        ids = torch.tensor([sample.tokens], dtype=torch.long)
        images = sample.images
        image_tokens = int((ids == image_token_id).sum())
        if images is None:
            if image_tokens:
                raise BatchError(f"sample {index}: {image_tokens} image token(s) and no images")
            rows.append(torch.arange(len(sample.tokens)).view(1, 1, -1).expand(3, 1, -1))
            continue
        problem = images.problem()
        if problem is not None:
            raise BatchError(f"sample {index}: images: {problem}")
        grid = torch.tensor(images.image_grid_thw, dtype=torch.long)
        wanted = int(grid.prod(dim=1).sum()) // (merge_size ** 2)
        if image_tokens != wanted:
            raise BatchError(f"sample {index}: {image_tokens} image token(s); its images take {wanted}")
        positions, _ = rope_positions(model, ids, grid, image_token_id)
        rows.append(positions)
        shape = tuple(images.pixel_shape)
        pixels.append(torch.frombuffer(bytearray(images.pixel_values), dtype=torch.float32).view(shape))
        grids.append(grid)
    device = batch.input_ids.device
    mrope = torch.cat(rows, dim=2).to(device)
    batch.position_ids = torch.cat([batch.position_ids.view(1, 1, -1), mrope], dim=0)
    if not pixels:  # text samples only: their positions, no vision inputs
        return
    batch.vision = {"pixel_values": torch.cat(pixels).to(device), "image_grid_thw": torch.cat(grids).to(device)}
    # shifted position t scores token t + 1: no loss (nor logprob comparison) on an image token
    scores_image = (batch.input_ids[:, 1:] == image_token_id).to(batch.loss_mask.dtype)
    batch.loss_mask = batch.loss_mask * (1 - scores_image)
