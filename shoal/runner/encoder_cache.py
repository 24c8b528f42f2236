"""Image embeddings by content: a vision model's tower runs once per distinct image.

The runner asks for an image's embeddings whenever a step computes some of its placeholder tokens: the first
chunk that reaches the image, every later chunk of it, and a recompute after preemption. The tower runs on
the first ask, on the whole image alone, and the rows are kept by the image's digest, least recently used
first out, within a byte budget (`--encoder-cache-memory`). Later asks, from this request or any other with
the same pixels, slice the kept rows. So a chunk boundary inside an image changes nothing, and neither does
the batch. A prompt whose image tokens the prefix cache already holds never asks at all.

The server warms the cache before a request reaches the engine (`warm`, on its media threads), so the tower
runs beside the engine's steps instead of inside one, where it would hold every other sequence for its whole
time. The step's own ask then finds the rows; it runs the tower itself only for what was evicted since.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

import torch

@dataclass
class EncoderStats:
    """Counters the engine's stats read (cumulative)."""

    images_encoded: int = 0  # the tower ran
    cache_hits: int = 0  # asks answered from the cache
    encode_seconds: float = 0.0  # time in the tower
    cached_bytes: int = 0
    cached_images: int = 0


class EncoderCache:
    """Used from the engine's thread and the server's media threads: a lock guards the entries and counters, and
    one digest is encoded by one thread at a time (a second asker waits for the first's rows)."""

    def __init__(self, tower, capacity_bytes: int) -> None:
        self.tower = tower  # model.vision.VisionTower
        self.capacity = capacity_bytes
        self.entries: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self.stats = EncoderStats()
        self._lock = threading.Lock()
        self._encoding: dict[bytes, threading.Lock] = {}  # digest -> held while a thread encodes it

    def warm(self, span) -> None:
        """Encode the image now unless the cache holds it (the server's media threads, before the request is sent)."""
        self.embeddings(span, count_hit=False)

    def embeddings(self, span, count_hit: bool = True) -> torch.Tensor:
        """The image's embeddings [span.length, hidden] (span: multimodal.ImageSpan)."""
        while True:
            with self._lock:
                rows = self.entries.get(span.digest)
                if rows is not None:
                    self.entries.move_to_end(span.digest)
                    self.stats.cache_hits += count_hit
                    return rows
                busy = self._encoding.get(span.digest)
                if busy is None:
                    busy = self._encoding[span.digest] = threading.Lock()
                    busy.acquire()
                    break
            with busy:  # another thread is encoding it: wait for it, then look again (its rows, or encode here
                pass  # if it failed or kept none: larger than the budget)
        try:
            start = time.perf_counter()
            rows = self.tower(span.pixels)
            seconds = time.perf_counter() - start
            if rows.shape[0] != span.length:
                raise ValueError(f"the vision tower gave {rows.shape[0]} rows for an image of {span.length} placeholder tokens")
            with self._lock:
                self.stats.encode_seconds += seconds
                self.stats.images_encoded += 1
                self._keep(span.digest, rows)
            return rows
        finally:
            with self._lock:
                del self._encoding[span.digest]
            busy.release()

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
