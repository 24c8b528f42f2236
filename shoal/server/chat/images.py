"""Images in a conversation: from the protocol's parts to the engine's ImageSpans. Protocol-neutral.

Each adapter turns a message with images into template parts, `{"type": "text", "text": ...}` and
`{"type": "image"}` in order, and lists an `ImageRef` per image part. Then, for every protocol alike:

1. `prepare_images` fetches and decodes each image (server/media.py, under the server's media policy), runs
   the model's processor on it (model/vision.py) and warms the encoder cache with the tower's output. That is
   blocking work, and a fetch can take seconds, so it runs on its own small thread pool: a slow URL holds a
   media thread, never the event loop or the threads that render other requests' prompts, and the tower runs
   beside the engine's steps, so the other sequences keep decoding.
2. The template renders the conversation, writing the model's image placeholder once per image part.
3. `place_images` replaces each placeholder with its image's tokens (as the model's processor writes them) and
   records where the tower's runs of them sit.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from shoal.model.vision import DETAILS, PreparedImage
from shoal.multimodal import ImageSpan, expand_placeholders
from shoal.server.chat.render import render_messages
from shoal.server.errors import bad_request
from shoal.server.media import MediaError, check_count, load_base64_image, load_image

MEDIA_THREADS = 4  # images fetched and prepared at once, over all requests
_pool = ThreadPoolExecutor(MEDIA_THREADS, thread_name_prefix="shoal-media")


@dataclass(frozen=True)
class ImageRef:
    """An image part as the request gave it, not yet fetched: a URL (OpenAI's image_url: data:, http(s) or
    file:), or base64 data with its media type (Anthropic's)."""

    where: str  # the request field, for messages
    kind: str  # what the protocol calls it ("image_url part", "image block"), for messages
    url: str | None = None
    data: str | None = None
    media_type: str | None = None
    detail: str | None = None


IMAGE_PART = {"type": "image"}  # what the template sees where an image goes


def template_content(parts: list[dict]) -> str | list[dict]:
    """A message's content as the template takes it: its text parts joined (as before images), or where it has
    an image, the text and image parts in order."""
    return parts if IMAGE_PART in parts else "\n".join(p["text"] for p in parts)


async def render_conversation(served, messages: list[dict], refs: list[ImageRef], tools: list[dict] | None = None,
                              template_kwargs: dict | None = None, add_generation_prompt: bool | None = None,
                              encode: bool = True) -> tuple[str, list[int], tuple[ImageSpan, ...]]:
    """The prompt's text, its token ids with every image's tokens in place, and where the images sit. encode:
    run the tower on the images now (a request to generate), not for a count of tokens."""
    if refs and served.engine.image_spec is None:
        raise bad_request(f"this model does not accept images ({refs[0].where} is an {refs[0].kind})", refs[0].where)
    images = await prepare_images(served, refs, encode)
    text, ids = await asyncio.to_thread(render_messages, served, messages, tools, template_kwargs, add_generation_prompt)
    ids, spans = place_images(served, ids, images)
    return text, ids, spans


async def prepare_images(served, refs: list[ImageRef], encode: bool = True) -> list[PreparedImage]:
    """Every image fetched, decoded and prepared (and with `encode`, its tower output cached), in order; any
    problem is a 400 that names the image."""
    if not refs:
        return []
    policy = served.settings.media_policy
    try:
        check_count(len(refs), policy, "messages")
    except MediaError as e:
        raise bad_request(str(e), "messages") from None
    loop = asyncio.get_running_loop()
    return list(await asyncio.gather(*(loop.run_in_executor(_pool, _prepare, served, ref, policy, encode) for ref in refs)))


def _prepare(served, ref: ImageRef, policy, encode: bool) -> PreparedImage:
    if ref.detail is not None and ref.detail not in DETAILS:
        raise bad_request(f"{ref.where}.detail must be one of {', '.join(DETAILS)}", f"{ref.where}.detail")
    try:
        if ref.data is not None:
            loaded = load_base64_image(ref.data, ref.media_type, policy, ref.where)
        else:
            loaded = load_image(ref.url or "", policy, ref.where)
    except MediaError as e:
        raise bad_request(str(e), ref.where) from None
    return served.engine.prepare_image(loaded.image, ref.detail, encode)  # the tower runs here, beside the engine's steps


def place_images(served, ids: list[int], images: list[PreparedImage], param: str = "messages") -> tuple[list[int], tuple[ImageSpan, ...]]:
    """The rendered prompt's ids with each image placeholder replaced by its image's tokens, and the spans the
    tower fills. The template must have written one placeholder per image part."""
    spec = served.engine.image_spec
    if spec is None:
        return ids, ()
    try:
        return expand_placeholders(ids, spec.image_token_id, images)
    except ValueError as e:
        raise bad_request(f"{e}: this model's template does not take images in every kind of message, or the "
                          f"text holds {spec.image_token!r}", param) from None
