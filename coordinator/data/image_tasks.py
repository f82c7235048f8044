"""The built-in vision-language task (`--prompt-data builtin:colour`): images of a coloured shape drawn at
start-up, the answer the colour's initial, so the default-job experience exists for a VLM too (docs/vlm.md).

Owns the images and prompts of `colour`. Each record is a 56 x 56 black picture holding one filled rectangle of
a random size and place in red, green or blue (with a little jitter in its shade); the prompt is a chat whose
user turn is the image then `colour?`; the label is `r`, `g` or `b`, scored by `first_digit` (the fraction of
the first 4 response characters equal to it), so a tiny VLM first learns to answer with those letters, then to
tell the colours apart. Invariant: the same (n, seed) gives the same images and labels.
"""

from __future__ import annotations

import random

from coordinator.data.source import PromptRecord

SIZE = 56  # one 2 x 2 merged grid of 28-pixel patches per side pair: 4 image tokens in the tiny VLM
COLOURS = {"r": (220, 30, 30), "g": (30, 200, 30), "b": (40, 60, 230)}
QUESTION = "colour?"
#: records drawn for a builtin:colour data source (kept small: each holds its decoded image in memory)
COLOUR_TASK_SIZE = 512


def make_colour_prompts(n: int, seed: int) -> list[PromptRecord]:
    from PIL import Image, ImageDraw

    rng = random.Random(f"rayless-colour:{seed}")
    records = []
    for index in range(n):
        label = rng.choice(sorted(COLOURS))
        shade = tuple(max(0, min(255, c + rng.randint(-25, 25))) for c in COLOURS[label])
        image = Image.new("RGB", (SIZE, SIZE), (0, 0, 0))
        width, height = rng.randint(16, SIZE - 8), rng.randint(16, SIZE - 8)
        left, top = rng.randint(0, SIZE - width), rng.randint(0, SIZE - height)
        ImageDraw.Draw(image).rectangle((left, top, left + width - 1, top + height - 1), fill=shade)
        records.append(PromptRecord(
            prompt=[{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}],
            label=label, metadata={"task": "colour"}, index=index, images=(image,)))
    return records
