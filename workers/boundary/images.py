"""Images from data files and requests, decoded under bounds: the one place image bytes become pixels.

Owns how an image reference is read (a path relative to the data file, `file://`, a base64 `data:` URL, raw
bytes, or a Parquet/`datasets` cell `{"bytes": ..., "path": ...}`) and the bounds it is held to: the encoded
size (`max_bytes`), the pixel count read from the header before any pixel is decoded (`max_pixels`, so a
20k x 20k image or a decompression bomb is refused at the cost of its header), a mode that converts to RGB, and
a complete decode (a truncated file is refused, never padded with grey as PIL may do).

Invariant: `decode_image` returns a fully loaded RGB image within the bounds, or raises BoundaryError naming
`where` (the data file's `file:line`, or the request) and why; it never fetches a URL.
"""

from __future__ import annotations

import base64
import binascii
import io
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from workers.boundary.errors import BoundaryError

if TYPE_CHECKING:
    from PIL.Image import Image

#: Modes that convert to RGB without losing what the picture shows; others (16-bit, float, ...) are refused.
CONVERTIBLE_MODES = frozenset({"RGB", "RGBA", "L", "LA", "P", "PA", "1", "CMYK", "YCbCr", "RGBX"})
DATA_URL_PREFIX = "data:"


@dataclass(frozen=True)
class ImageLimits:
    max_bytes: int = 16 << 20
    max_pixels: int = 4096 * 4096


DEFAULT_IMAGE_LIMITS = ImageLimits()


def image_bytes(reference: object, where: str, base_dir: Path | None, limits: ImageLimits) -> bytes:
    """The encoded bytes a reference names, read under `limits.max_bytes`."""
    if isinstance(reference, dict):
        if reference.get("bytes") is not None:
            return image_bytes(reference["bytes"], where, base_dir, limits)
        if reference.get("path") is not None:
            return image_bytes(reference["path"], where, base_dir, limits)
        if reference.get("image") is not None:  # slime's rich form {"type": "image", "image": ...}
            return image_bytes(reference["image"], where, base_dir, limits)
        raise BoundaryError(where, "an image object needs 'bytes', 'path' or 'image'")
    if isinstance(reference, (bytes, bytearray, memoryview)):
        data = bytes(reference)
        if len(data) > limits.max_bytes:
            raise BoundaryError(where, f"the image is {len(data):,} bytes; the limit is {limits.max_bytes:,}")
        return data
    if not isinstance(reference, str) or not reference:
        raise BoundaryError(where, f"an image must be a path, a data URL or bytes, not {type(reference).__name__}")
    if reference.startswith(DATA_URL_PREFIX):
        head, _, payload = reference.partition(",")
        if not head.endswith(";base64"):
            raise BoundaryError(where, "a data URL image must be base64 (data:image/...;base64,...)")
        if len(payload) > limits.max_bytes * 4 // 3 + 4:
            raise BoundaryError(where, f"the image's data URL is over the {limits.max_bytes:,}-byte limit")
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise BoundaryError(where, "the image's data URL is not valid base64") from None
    if "://" in reference and not reference.startswith("file://"):
        raise BoundaryError(where, f"image {reference[:80]!r}: only paths, file:// and data URLs are read "
                                   "(nothing is fetched from the network)")
    path = Path(reference.removeprefix("file://"))
    if not path.is_absolute() and base_dir is not None:
        path = base_dir / path
    try:
        size = path.stat().st_size
        if size > limits.max_bytes:
            raise BoundaryError(where, f"image {str(path)!r} is {size:,} bytes; the limit is {limits.max_bytes:,}")
        return path.read_bytes()
    except OSError as error:
        raise BoundaryError(where, f"image {str(path)!r} cannot be read: {error.strerror or error}") from None


def decode_image(reference: object, where: str, *, base_dir: Path | None = None,
                 limits: ImageLimits = DEFAULT_IMAGE_LIMITS) -> Image:
    """A loaded RGB image from a reference (see the module docstring), or a BoundaryError naming `where`."""
    from PIL import Image as PilImage
    from PIL import UnidentifiedImageError

    data = image_bytes(reference, where, base_dir, limits)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", PilImage.DecompressionBombWarning)
            image = PilImage.open(io.BytesIO(data))
            width, height = image.size  # from the header: nothing decoded yet
            if width * height > limits.max_pixels:
                raise BoundaryError(where, f"the image is {width}x{height} pixels; the limit is "
                                           f"{limits.max_pixels:,} pixels (a decompression bomb is refused)")
            if image.mode not in CONVERTIBLE_MODES:
                raise BoundaryError(where, f"the image's mode {image.mode!r} does not convert to RGB")
            image.load()  # a truncated file raises here (ImageFile.LOAD_TRUNCATED_IMAGES stays false)
    except BoundaryError:
        raise
    except (PilImage.DecompressionBombError, PilImage.DecompressionBombWarning) as error:
        # PIL's own check at open (past twice its MAX_IMAGE_PIXELS), before ours could read the size
        raise BoundaryError(where, f"the image is over the limit of {limits.max_pixels:,} pixels (a "
                                   f"decompression bomb is refused): {error}") from None
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as error:
        raise BoundaryError(where, f"the image cannot be decoded: {error}") from None
    return image if image.mode == "RGB" else image.convert("RGB")


def encode_data_url(image: Image) -> str:
    """An image as the PNG data URL SGLang's `image_data` takes (slime's encode_image_for_rollout_engine)."""
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")
