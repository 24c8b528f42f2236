"""The allocator setting the engine applies on the CPU, seen from glibc's own counters."""

import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only")

PROBE = r"""
import ctypes, sys, torch
from shoal.runner.host import keep_freed_memory

class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2
if sys.argv[1] == "tuned":
    assert keep_freed_memory()
before = libc.mallinfo2().hblks
t = torch.empty(4 << 20, dtype=torch.uint8)  # a step-sized temporary: 4 MiB
during = libc.mallinfo2().hblks
del t
print(during - before)
"""


def _mmapped_blocks_for_a_4mib_tensor(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True)
    return int(out.stdout.strip().splitlines()[-1])


def test_step_sized_temporaries_come_from_the_heap_once_tuned():
    # glibc's default serves 4 MiB with its own mmap (and unmaps it on free, every step); tuned, the heap serves it.
    assert _mmapped_blocks_for_a_4mib_tensor("default") == 1
    assert _mmapped_blocks_for_a_4mib_tensor("tuned") == 0
