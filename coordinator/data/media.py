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
size and pixel bounds; only the `image` type is served (video and audio are refused at start-up). A record
keeps its images encoded (`ImageRef`: the bytes, or the file's path), checked by a full decode when read and
decoded again when taken, so a data set's memory is its encoded size, not its pixels.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from workers.boundary.errors import BoundaryError
from workers.boundary.images import decode_image, image_bytes
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


@dataclass(frozen=True)
class ImageRef:
    """One image of a data row, kept encoded: its bytes (Parquet bytes, a data URL's) or its resolved file."""

    where: str
    data: bytes | None = None
    path: Path | None = None

    def load(self) -> Image:
        """The decoded RGB image, under the boundary's bounds (a file changed since start-up is checked again)."""
        try:
            return decode_image(self.data if self.data is not None else str(self.path), self.where)
        except BoundaryError as error:
            raise MediaError(str(error)) from None


def load_images(images: tuple[object, ...]) -> tuple[Image, ...]:
    """A record's images decoded: ImageRefs loaded, images drawn in memory (the built-in task's) as they are."""
    return tuple(image.load() if isinstance(image, ImageRef) else image for image in images)  # type: ignore[misc]


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
                      ) -> tuple[list[dict[str, JsonValue]], tuple[ImageRef, ...]]:
    """The row's prompt as chat messages with image parts, and its images (each decoded once to check it, then
    kept encoded), in prompt order."""
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
        name = f"{where}: {column}[{position}]"
        try:
            decode_image(reference, name, base_dir=base_dir)  # the whole check, pixels discarded
            images.append(_keep(reference, name, base_dir))
        except BoundaryError as error:
            raise MediaError(str(error)) from None
    return messages, tuple(images)


def _keep(reference: object, where: str, base_dir: Path | None) -> ImageRef:
    """What a checked reference is kept as: a local file by its path, anything else by its encoded bytes."""
    if isinstance(reference, dict):
        reference = next(reference[key] for key in ("bytes", "path", "image") if reference.get(key) is not None)
    if isinstance(reference, str) and not reference.startswith("data:"):
        path = Path(reference.removeprefix("file://"))
        return ImageRef(where, path=path if path.is_absolute() or base_dir is None else base_dir / path)
    from workers.boundary.images import DEFAULT_IMAGE_LIMITS

    return ImageRef(where, data=image_bytes(reference, where, base_dir, DEFAULT_IMAGE_LIMITS))
