"""Images in a session's chat (docs/vlm.md#the-session-server-with-images): OpenAI `image_url` content parts
for a vision-language policy, from the agent's request to the engine's `image_data` and the trained sample.

Owns which image parts a session takes (`{"type": "image_url", "image_url": {"url": "data:image/...;base64,..."}}`
or `"image_url": "data:..."`; an http(s) or file URL is refused — nothing is fetched, no coordinator file read),
how the chat template sees them (`{"type": "image"}`, as the data path renders `<image>`), the expansion of each
image's placeholder in the prompt ids to its grid's tokens (`expand_image_runs`), and the agent's prompt with the
data's images as image parts (`agent_messages`).

Invariants: every image is decoded under the boundary layer's bounds (`workers.boundary.images`) before its
tokens reach an engine; the prompt ids hold exactly the image tokens the images' grids take, in order, or
SessionRequestError.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from coordinator.sessions.tito import SessionRequestError
from workers.boundary.errors import BoundaryError
from workers.boundary.images import DATA_URL_PREFIX, decode_image, encode_data_url
from workers.boundary.json_input import JsonObject, JsonValue
from workers.engine.openai_protocol import image_url_of
from workers.engine.sampling_params import RequestError

if TYPE_CHECKING:
    from PIL.Image import Image

    from workers.vlm_processor import PixelInputs, VlmProcessor


def _part_url(part: JsonObject, where: str) -> str:
    try:
        url = image_url_of(part, where)
    except RequestError as error:
        raise SessionRequestError(str(error)) from None
    if not url.startswith(DATA_URL_PREFIX):
        raise SessionRequestError(f"{where}: image {url[:80]!r}: a session takes images as base64 data URLs "
                                  "(data:image/png;base64,...); nothing is fetched from the network")
    return url


def image_urls(messages: Sequence[JsonValue]) -> list[str]:
    """The data URLs of the messages' image parts, in order (SessionRequestError naming a bad one)."""
    urls = []
    for index, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            continue
        for position, part in enumerate(content):
            if isinstance(part, dict) and part.get("type") == "image_url":
                urls.append(_part_url(part, f"messages[{index}].content[{position}]"))
    return urls


def template_messages(messages: Sequence[JsonObject]) -> list[JsonObject]:
    """The messages as a VLM's chat template takes them: image_url parts as `{"type": "image"}`, text parts kept,
    a null content as "" (as the engine renders it)."""
    out = []
    for message in messages:
        content = message.get("content")
        item = {key: value for key, value in message.items() if value is not None}
        if isinstance(content, list):
            item["content"] = [{"type": "image"} if isinstance(part, dict) and part.get("type") == "image_url"
                               else part for part in content]
        elif content is None:
            item["content"] = ""
        out.append(item)
    return out


def decode_urls(urls: Sequence[str]) -> list[Image]:
    """The images, decoded under the boundary's bounds (SessionRequestError naming the image)."""
    try:
        return [decode_image(url, f"image {index}") for index, url in enumerate(urls)]
    except BoundaryError as error:
        raise SessionRequestError(str(error)) from None


def expand_image_runs(ids: Sequence[int], pixels: PixelInputs | None, processor: VlmProcessor) -> list[int]:
    """`ids` with each image's placeholder run expanded to its grid's token count: a run already that long (the
    stored ids of earlier turns) kept, a single placeholder (the newly rendered messages) expanded. `pixels`
    None: no images, so no image token may appear (one written in a message's text is refused)."""
    token = processor.image_token_id
    wanted = [] if pixels is None else [processor.image_tokens(grid.tolist()) for grid in pixels.image_grid_thw]
    out: list[int] = []
    index, image = 0, 0
    while index < len(ids):
        if ids[index] != token:
            out.append(ids[index])
            index += 1
            continue
        end = index
        while end < len(ids) and ids[end] == token:
            end += 1
        if image >= len(wanted) or (end - index) not in (1, wanted[image]):
            raise SessionRequestError(f"the prompt's image placeholders do not match its {len(wanted)} image(s) "
                                      f"(an image token written in a message's text?)")
        out += [token] * wanted[image]
        image, index = image + 1, end
    if image != len(wanted):
        raise SessionRequestError(f"the prompt holds {image} image placeholder(s) for {len(wanted)} image(s)")
    return out


def agent_messages(prompt: JsonValue, images: Sequence[Image]) -> JsonValue:
    """A chat prompt whose `{"type": "image"}` parts take the sample's images, in order, as OpenAI image_url
    parts (PNG data URLs), the form an agent's OpenAI client sends; any other prompt unchanged."""
    if not images or not isinstance(prompt, list):
        return prompt
    remaining = list(images)
    out = []
    for message in prompt:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list):
            parts = []
            for part in content:
                if isinstance(part, dict) and part.get("type") == "image" and remaining:
                    part = {"type": "image_url", "image_url": {"url": encode_data_url(remaining.pop(0))}}
                parts.append(part)
            message = {**message, "content": parts}
        out.append(message)
    return out
