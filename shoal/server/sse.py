"""Server-sent events, with the per-token chunk built from precomputed parts.

A streamed token is one small JSON object that differs from the previous one
only in its text. Serializing the whole dict per token spends most of the time
re-encoding the same id, model name and structure, so `DeltaEncoder` encodes a
template chunk once, with a sentinel where the text goes, splits it there into a
prefix and a suffix, and per token only escapes the text with `json.dumps(str)`
(seeds/000 section 8). Because the template itself goes through `json.dumps`,
the result is byte for byte what `encode_event(chunk)` gives for the full dict
(the tests check it); anything rarer (role, finish, usage, logprobs) uses
`encode_event` directly.

The one serialization everything uses: compact separators, UTF-8 (not \\u escapes).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

DONE = b"data: [DONE]\n\n"

_SENTINEL = "\x00shoal-delta\x00"
_DUMPED_SENTINEL = json.dumps(_SENTINEL, ensure_ascii=False)


def dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def encode_event(obj: Any) -> bytes:
    """One SSE event carrying `obj` as JSON."""
    return b"data: " + dumps(obj).encode() + b"\n\n"


class DeltaEncoder:
    """Encode chunks that differ only in one string field, one template per key.

    `make_chunk(key, text)` builds the full chunk for `key` (for example a choice
    index); it is called once per key with a sentinel as the text.
    """

    def __init__(self, make_chunk: Callable[[Any, str], dict]) -> None:
        self._make_chunk = make_chunk
        self._parts: dict[Any, tuple[bytes, bytes]] = {}

    def _split(self, key: Any) -> tuple[bytes, bytes]:
        text = dumps(self._make_chunk(key, _SENTINEL))
        head, sep, tail = text.partition(_DUMPED_SENTINEL)
        if not sep or _DUMPED_SENTINEL in tail:
            raise ValueError("the chunk template must hold the delta text exactly once")
        return b"data: " + head.encode(), tail.encode() + b"\n\n"

    def encode(self, key: Any, text: str) -> bytes:
        parts = self._parts.get(key)
        if parts is None:
            parts = self._parts[key] = self._split(key)
        prefix, suffix = parts
        return prefix + json.dumps(text, ensure_ascii=False).encode() + suffix
