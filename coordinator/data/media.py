"""slime's `--multimodal-keys` on a prompt row: the row's images decoded (bounded) and its prompt made the chat
messages with `{"type": "image"}` parts that a vision-language model's chat template renders.

Owns slime's `_build_messages` rule: `--multimodal-keys '{"image": "images"}'` maps a media type to the column
holding a row's media (a list, or one value); a text prompt (or each text message content of a chat) is split
at every `<image>` placeholder, and each placeholder takes the next image of the column, in order. A plain-text
prompt becomes one user message, as slime makes it a conversation whenever multimodal keys are given. A chat
whose contents are already lists of parts is kept as it is (slime's too), its `{"type": "image"}` parts then
taking the column's images in order.

Invariants: a row's image count equals its placeholders (slime asserts "not enough" and silently drops extra
images; both are refused here, naming `file:line`); every image is decoded through `workers.boundary.images`
(paths relative to the data file, `file://`, data URLs, bytes or a Parquet `{"bytes", "path"}` cell) within its
size and pixel bounds; only the `image` type is served (video and audio are refused at start-up).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from workers.boundary.errors import BoundaryError
from workers.boundary.images import decode_image
from workers.boundary.json_input import JsonValue
from workers.errors import RaylessError

if TYPE_CHECKING:
    from PIL.Image import Image

#: slime's MultimodalTypes placeholders, for the types rayless serves
PLACEHOLDERS = {"image": "<image>"}
#: slime's other media types, refused by name
UNSERVED_TYPES = ("video", "audio")


class MediaError(RaylessError, ValueError):
    """A row's media that cannot be used: a missing column, a count that does not fit, an image refused."""


def media_types_problem(keys: Mapping[str, str]) -> str | None:
    """Why a `--multimodal-keys` mapping cannot be served, or None."""
    for media, column in keys.items():
        if media in UNSERVED_TYPES:
            return f"{media!r}: only images are served by rayless' engines and trainer so far (docs/vlm.md)"
        if media not in PLACEHOLDERS:
            return f"{media!r} is not a media type slime knows (image, video, audio)"
        if not isinstance(column, str) or not column:
            return f"{media!r} must map to a column name, got {column!r}"
    return None


def multimodal_prompt(prompt: str | list[dict[str, JsonValue]], row: Mapping[str, JsonValue], where: str,
                      keys: Mapping[str, str], base_dir: Path | None
                      ) -> tuple[list[dict[str, JsonValue]], tuple[Image, ...]]:
    """The row's prompt as chat messages with image parts, and its images decoded, in prompt order."""
    column = keys["image"]
    if column not in row:
        raise MediaError(f"{where}: key {column!r} (--multimodal-keys image) is missing; the record has "
                         f"{sorted(row)}")
    value = row[column]
    references = [] if value is None else value if isinstance(value, list) else [value]
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]
    placeholder = PLACEHOLDERS["image"]
    slots = 0
    for message in messages:
        content = message.get("content")
        if isinstance(content, str):
            parts: list[JsonValue] = []
            for segment in re.split(f"({re.escape(placeholder)})", content):
                if segment == placeholder:
                    parts.append({"type": "image"})
                    slots += 1
                elif segment:
                    parts.append({"type": "text", "text": segment})
            message["content"] = parts
        elif isinstance(content, list):
            slots += sum(1 for part in content if isinstance(part, dict) and part.get("type") == "image")
    if slots != len(references):
        raise MediaError(f"{where}: the prompt has {slots} {placeholder} placeholder(s) for "
                         f"{len(references)} image(s) in {column!r}")
    images = []
    for position, reference in enumerate(references):
        try:
            images.append(decode_image(reference, f"{where}: {column}[{position}]", base_dir=base_dir))
        except BoundaryError as error:
            raise MediaError(str(error)) from None
    return messages, tuple(images)
