"""Image embeddings by content: a vision model's tower runs once per distinct image.

The runner asks for an image's embeddings whenever a step computes some of its placeholder tokens: the first
chunk that reaches the image, every later chunk of it, and a recompute after preemption. The tower runs on
the first ask, on the whole image alone, and the rows are kept by the image's digest, least recently used
first out, within a byte budget (`--encoder-cache-memory`). Later asks, from this request or any other with
the same pixels, slice the kept rows. So a chunk boundary inside an image changes nothing, and neither does
the batch. A prompt whose image tokens the prefix cache already holds never asks at all.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass

import torch

log = logging.getLogger("shoal.runner")


@dataclass
class EncoderStats:
    """Counters the engine's stats read (cumulative)."""

    images_encoded: int = 0  # the tower ran
    cache_hits: int = 0  # asks answered from the cache
    encode_seconds: float = 0.0  # time in the tower
    cached_bytes: int = 0
    cached_images: int = 0


class EncoderCache:
    def __init__(self, tower, capacity_bytes: int) -> None:
        self.tower = tower  # model.vision.VisionTower
        self.capacity = capacity_bytes
        self.entries: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self.stats = EncoderStats()

    def embeddings(self, span) -> torch.Tensor:
        """The image's embeddings [span.length, hidden] (span: multimodal.ImageSpan)."""
        rows = self.entries.get(span.digest)
        if rows is not None:
            self.entries.move_to_end(span.digest)
            self.stats.cache_hits += 1
            return rows
        start = time.perf_counter()
        rows = self.tower(span.pixels)
        self.stats.encode_seconds += time.perf_counter() - start
        self.stats.images_encoded += 1
        if rows.shape[0] != span.length:
            raise ValueError(f"the vision tower gave {rows.shape[0]} rows for an image of {span.length} placeholder tokens")
        self._keep(span.digest, rows)
        return rows

    def _keep(self, digest: bytes, rows: torch.Tensor) -> None:
        size = rows.numel() * rows.element_size()
        if size > self.capacity:
            return  # larger than the whole budget: used once, not kept
        while self.stats.cached_bytes + size > self.capacity:
            _, old = self.entries.popitem(last=False)
            self.stats.cached_bytes -= old.numel() * old.element_size()
        self.entries[digest] = rows
        self.stats.cached_bytes += size
        self.stats.cached_images = len(self.entries)
