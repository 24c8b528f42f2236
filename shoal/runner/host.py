"""Process-wide settings for running torch on the host CPU.

glibc's malloc serves every allocation above 128 KiB with a fresh mmap and
gives the pages back on free, and it trims the heap's top whenever 128 KiB
lie free there. A decode or prefill step allocates and frees megabytes of
temporaries per layer (gathered K/V, attention scores, activations), so
without this each of them pays page faults and zeroing again on every step:
a masked attention over 135 queries x 735 keys took 3.5-4.3 ms instead of
0.7-1.0 ms (benchmarks/NOTES.md). Serving keeps those pages instead: below
32 MiB everything comes from the heap, and up to 256 MiB of freed heap stays
mapped for the next step. This is what jemalloc or tcmalloc, the allocators
recommended for CPU inference, do by default, without an LD_PRELOAD.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger("shoal.runner")

# mallopt(3) parameter numbers from glibc's <malloc.h>.
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3

MMAP_THRESHOLD = 32 << 20  # glibc's largest accepted value on 64-bit
TRIM_THRESHOLD = 256 << 20

_done = False


def keep_freed_memory() -> bool:
    """Tune glibc's malloc for step-sized temporaries; False where that is not glibc."""
    global _done
    if _done:
        return True
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        log.info("not glibc (libc %s): leaving the allocator as it is", name)
        return False
    ok = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    if ok:
        log.info("malloc: temporaries below %d MiB come from the heap, %d MiB of freed memory kept for reuse",
                 MMAP_THRESHOLD >> 20, TRIM_THRESHOLD >> 20)
    _done = ok
    return ok
