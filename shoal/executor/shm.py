"""Collectives between ranks on one machine through shared memory, instead of gloo over loopback.

gloo costs 0.7-1.1 ms per all-gather of one step's partial outputs and 4-5 ms
per broadcast of a pickled step on this project's 2-core machine
(benchmarks/NOTES.md), while SmolLM2-135M's whole decode step computes in about
15 ms: with four gathers per layer gloo would be most of a tensor-parallel step.
vLLM's CPU backend meets the same problem with a shared-memory all-reduce
between the ranks of one host; this is the same idea in a few numpy stores.

One segment in /dev/shm, created by rank 0 and mapped by every rank:

    posted[size]   int64  the last gather each rank has put its part in for
    read[size]     int64  the last broadcast each rank has taken
    sent           int64  the last broadcast rank 0 has written; length of its pickle
    message        bytes  the broadcast's pickle
    parts[2][size] bytes  each rank's part, two sets used alternately

A gather: write my part into set (n % 2), store posted[me] = n, wait until
every rank has posted n, copy the parts out side by side. A rank that reaches
gather n + 2 has seen every rank post n + 1, which each did after copying
gather n's parts, so two sets are enough. Stores on x86 become visible in
program order, so a rank that sees posted[r] = n sees r's part too.

Waiting spins (a gather's parts arrive within microseconds), then yields, then
sleeps: an idle worker polls for the next step at most every few milliseconds.
A rank that does not answer within the timeout raises instead of waiting forever.
"""

from __future__ import annotations

import os
import pickle
import time
import uuid

import numpy as np
import torch

HEADER = 64  # bytes of each int64 array's slot, rounded up
SPIN = 200  # polls (about 0.3 ms) before a waiting rank starts yielding its core
NATIVE_SPIN = 4000  # the native gather's polls (a pause each: about 70 us on the 2-core Xeon) before it hands the wait back


def native_gather() -> bool:
    """Whether gathers take the native op (shoal.kernels' shm_gather): one call where Python makes about ten."""
    from shoal import kernels

    return kernels.available()


class SharedMemoryChannel:
    def __init__(self, path: str, rank: int, size: int, part_bytes: int, message_bytes: int, create: bool, timeout: float, alive=None) -> None:
        self.path, self.rank, self.size, self.timeout = path, rank, size, timeout
        self.alive = alive or (lambda: True)  # False once a rank this process watches has died
        self.part_bytes, self.message_bytes = part_bytes, message_bytes
        ints = -(-8 * size // HEADER) * HEADER
        self._layout = (ints, ints, 16, message_bytes, 2 * size * part_bytes)
        total = sum(self._layout)
        if create:
            with open(path, "wb") as f:
                f.truncate(total)
        self._raw = torch.from_file(path, shared=True, size=total, dtype=torch.uint8)
        buf = self._raw.numpy()
        off = 0
        views = []
        for n in self._layout:
            views.append(buf[off : off + n])
            off += n
        self.posted = views[0][: 8 * size].view(np.int64)
        self.read = views[1][: 8 * size].view(np.int64)
        self.sent = views[2].view(np.int64)  # [sequence, length]
        self.message = views[3]
        parts = self._raw[off - self._layout[4] :]
        # [set][rank]: each rank's slot in each of the two sets, and typed views of them by dtype
        self._slots = [[parts[(k * size + r) * part_bytes : (k * size + r + 1) * part_bytes] for r in range(size)] for k in range(2)]
        self._parts = parts  # every slot, for the native gather
        self._posted = self._raw[: 8 * size].view(torch.int64)  # `posted` as a tensor over the same bytes
        self._typed: dict[torch.dtype, list[list[torch.Tensor]]] = {}
        self._gathers = 0
        self._messages = 0
        self.waited = 0.0  # seconds spent waiting for other ranks (benchmarks read it)

    @staticmethod
    def new_path() -> str:
        return f"/dev/shm/shoal-tp-{os.getpid()}-{uuid.uuid4().hex[:8]}"

    # ------------------------------------------------------------ gather
    def rows_that_fit(self, width: int, element_size: int) -> int:
        """How many rows of `width` values of `element_size` bytes a rank's slot holds."""
        return self.part_bytes // (width * element_size)

    def gather(self, part: torch.Tensor, widths: tuple[int, ...]) -> torch.Tensor:
        """Every rank's part [T, widths[r]] side by side in rank order: [T, sum(widths)], the same on every rank."""
        self._gathers += 1
        n = self._gathers
        if native_gather():
            part = part.contiguous()
            gather = torch.ops.shoal_kernels.shm_gather
            out = gather(part, self._parts, self._posted, self.rank, n, widths, self.part_bytes, NATIVE_SPIN)
            if out is None:  # a rank is slower: wait as the Python path does, then take the parts
                self._wait_for_every_rank(n)
                out = gather(part, self._parts, self._posted, self.rank, n, widths, self.part_bytes, 0)
            return out
        views = self._typed.get(part.dtype)
        if views is None:
            views = self._typed[part.dtype] = [[t.view(part.dtype) for t in parts] for parts in self._slots]
        parts = views[n & 1]
        rows = part.shape[0]
        parts[self.rank][: part.numel()].view(part.shape).copy_(part)
        self.posted[self.rank] = n
        self._wait_for_every_rank(n)
        return torch.cat([parts[r][: rows * w].view(rows, w) for r, w in enumerate(widths)], dim=1)

    # ------------------------------------------------------------ broadcast
    def send(self, obj) -> bool:
        """Rank 0: publish `obj`; False (nothing sent) when its pickle does not fit: use another channel."""
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        fits = len(data) <= self.message_bytes
        self._messages += 1
        n = self._messages
        self._wait(lambda: self.read[1:].min() >= n - 1, "the previous step")
        if fits:
            self.message[: len(data)] = np.frombuffer(data, dtype=np.uint8)
        self.sent[1] = len(data) if fits else -1
        self.sent[0] = n
        return fits

    def receive(self):
        """Other ranks: the next object rank 0 sent; (False, None) when it did not fit (see `send`)."""
        self._messages += 1
        n = self._messages
        self._wait(lambda: self.sent[0] >= n, "the next step", idle=True)
        length = int(self.sent[1])
        obj = pickle.loads(self.message[:length].tobytes()) if length >= 0 else None
        self.read[self.rank] = n
        return length >= 0, obj

    # ------------------------------------------------------------ waiting
    def _wait_for_every_rank(self, n: int) -> None:
        """Until every rank has posted its part of gather n."""
        posted = self.posted
        for r in range(self.size):
            self._wait(lambda r=r: posted[r] >= n, "a gather")

    def _wait(self, done, what: str, idle: bool = False) -> None:
        if done():
            return
        start = time.monotonic()
        try:
            self._poll(done, what, idle, start)
        finally:
            self.waited += time.monotonic() - start

    def _poll(self, done, what: str, idle: bool, start: float) -> None:
        polls = 0
        while not done():
            polls += 1
            if polls < SPIN:
                continue
            if polls < 2 * SPIN or not idle:
                os.sched_yield()
            else:
                time.sleep(min(0.002, 1e-5 * (polls - 2 * SPIN) + 1e-5))
            if polls % 256 == 0:
                if not self.alive():
                    raise RuntimeError(f"rank {self.rank}: a tensor-parallel rank died while this one waited for {what}")
                if not idle and time.monotonic() - start > self.timeout:
                    raise RuntimeError(f"rank {self.rank}: no answer from the other ranks for {self.timeout:.0f}s, waiting for {what}")

    def close(self, unlink: bool) -> None:
        self._raw = self._slots = self._typed = self._parts = self._posted = None
        self.posted = self.read = self.sent = self.message = None
        if unlink:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
