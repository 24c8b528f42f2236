"""Images in a token sequence: where they sit, what they are, and the positions they give. Plain Python, no torch.

A prompt holds an image as a run of placeholder tokens, one per row of the vision tower's output:

    token ids:  | text ... | <img> <img> ... <img> | text ... |
                           offset                 offset + length

The placeholders all have the same id, so the token ids alone cannot tell two images apart. Each span carries
its image's content digest (SHA-256 over the decoded pixels and the processor's settings): the prefix cache
keys every placeholder by it (`extra_keys`), and the runner's encoder cache finds the image's embeddings by it.

Qwen2-VL's decoder places tokens with three position rows (time, height, width: M-RoPE). A text token has the
same position in all three, its index plus a shift; an image's tokens take the rows of their cell in the
image's grid, from the position where the image starts. The text after an image resumes at that start plus
the grid's larger side, so each image shifts the positions after it by max(h, w) - length (`mrope_positions`).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace


@dataclass(frozen=True, eq=False)
class ImageSpan:
    """One image's placeholder tokens in a prompt."""

    offset: int  # index of its first placeholder token
    length: int  # placeholder tokens: the vision tower's output rows for it
    digest: bytes  # SHA-256 over the pixels and the processor settings: the caches' key
    grid: tuple[int, int, int]  # (t, h, w) of its tokens: the grid the decoder sees, after the tower's merge
    pixels: object = None  # the processor's tensors, which the vision tower takes (opaque here)

    @property
    def end(self) -> int:
        return self.offset + self.length

    @property
    def advance(self) -> int:
        """How far the image moves the M-RoPE position of the text that follows it."""
        return max(self.grid[1], self.grid[2])


def expand_placeholders(ids: list[int], image_token_id: int, images) -> tuple[list[int], tuple[ImageSpan, ...]]:
    """A rendered prompt's ids, where the template wrote the placeholder once per image, with each replaced by
    its image's tokens, and the spans the tower fills. images: model.vision.PreparedImage (`tokens`, and `tiles`:
    spans counted from the image's first token), in the order of the placeholders. ValueError if the counts
    differ."""
    found = [i for i, t in enumerate(ids) if t == image_token_id]
    if len(found) != len(images):
        raise ValueError(f"the chat template placed {len(found)} image(s) but the conversation has {len(images)}")
    out: list[int] = []
    spans = []
    prev = 0
    for at, image in zip(found, images):
        out.extend(ids[prev:at])
        spans.extend(replace(t, offset=len(out) + t.offset) for t in image.tiles)
        out.extend(image.tokens)
        prev = at + 1
    out.extend(ids[prev:])
    return out, tuple(spans)


def check_spans(images: tuple[ImageSpan, ...], token_ids, image_token_id: int) -> None:
    """Raise ValueError unless the spans are in order, apart, inside the prompt, sized by their grids, and cover
    exactly the placeholder tokens that are there."""
    end = 0
    for span in images:
        t, h, w = span.grid
        if span.offset < end or span.length != t * h * w or span.length < 1 or span.end > len(token_ids):
            raise ValueError("image spans overlap, leave the prompt, or disagree with their grids")
        if any(token_ids[i] != image_token_id for i in range(span.offset, span.end)):
            raise ValueError("an image span covers tokens that are not the image placeholder")
        end = span.end
    placeholders = sum(1 for t in token_ids if t == image_token_id)
    if placeholders != sum(s.length for s in images):
        raise ValueError(f"the prompt holds {placeholders} image placeholder tokens, but its images account for "
                         f"{sum(s.length for s in images)}")


def extra_keys(images: tuple[ImageSpan, ...]) -> dict[int, bytes] | None:
    """The prefix cache's extra key of every placeholder token: its image's digest (Sequence.extra_keys)."""
    if not images:
        return None
    return {i: span.digest for span in images for i in range(span.offset, span.end)}


def mrope_positions(images: tuple[ImageSpan, ...], start: int, end: int) -> tuple[list[int], list[int], list[int]]:
    """The (time, height, width) position rows of tokens [start, end) of a sequence whose prompt holds `images`
    (in order). Tokens past the prompt (outputs, drafts) are text: index plus every image's shift."""
    rows: tuple[list[int], list[int], list[int]] = ([], [], [])
    shift, i = 0, start  # i: the next token to place

    def text(a: int, b: int) -> None:  # text tokens [a, b)
        for row in rows:
            row.extend(range(a + shift, b + shift))

    for img in images:
        if img.end <= start:
            shift += img.advance - img.length
            continue
        if img.offset >= end:
            break
        if img.offset > i:
            text(i, img.offset)
        first = img.offset + shift  # where the image's cells start
        _, h, w = img.grid
        for k in range(max(img.offset, i), min(img.end, end)):
            cell = k - img.offset
            rows[0].append(first + cell // (h * w))
            rows[1].append(first + cell // w % h)
            rows[2].append(first + cell % w)
        shift += img.advance - img.length
        i = min(img.end, end)
    if i < end:
        text(i, end)
    return rows


_DIGEST_STRIP_ROWS = 256  # pixel_digest hashes this many rows at a time, so no full copy of a large image


def pixel_digest(image) -> bytes:
    """SHA-256 (32 bytes) over a decoded Pillow image's mode, size and raw pixels.

    The same picture gives the same digest however it was sent (PNG or lossless WebP,
    base64, URL or file), so it can key a cache of image features.
    """
    width, height = image.size
    digest = hashlib.sha256(f"{image.mode}:{width}x{height}:".encode())
    for top in range(0, height, _DIGEST_STRIP_ROWS):  # row-major strips hash the same as one tobytes()
        digest.update(image.crop((0, top, width, min(top + _DIGEST_STRIP_ROWS, height))).tobytes())
    return digest.digest()
