"""The process's resident memory as Linux reports it, for tests and benchmarks that measure real peaks.

``status("VmHWM")`` is the peak resident set since the process started or since the last
``reset_peak()`` (which writes 5 to /proc/self/clear_refs: VmHWM := VmRSS now). Linux only; callers
skip where /proc is missing. ``heap_in_use()`` is what the C heap holds live (glibc's ``mallinfo2``): unlike
the resident set it drops when memory is freed, so two runs' live bytes can be set against their role bytes.
Holds nothing.
"""

from __future__ import annotations

import gc
import os
import struct


def status(field: str, path: str = "/proc/self/status") -> int:
    """A figure of /proc/self/status (VmRSS, VmHWM, ...) or, with ``path``, /proc/meminfo, in bytes."""
    with open(path, encoding="ascii") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def reset_peak() -> int:
    """Collect garbage, reset VmHWM to the current RSS and return that RSS (bytes)."""
    gc.collect()
    with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
        f.write("5")
    return status("VmRSS")



def resident_in_range(address: int, nbytes: int) -> int:
    """Bytes of the pages in [address, address + nbytes) that are resident now (the "present" bit of
    /proc/self/pagemap, readable without privileges), e.g. a stage-3 unit's "mapped" buffer."""
    page = os.sysconf("SC_PAGE_SIZE")
    first, last = address // page, (address + nbytes - 1) // page
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(first * 8)
        raw = f.read((last - first + 1) * 8)
    present = sum(1 for (entry,) in struct.iter_unpack("<Q", raw) if entry >> 63)
    return present * page



def heap_in_use() -> int | None:
    """Bytes the C heap holds for live allocations now, over every arena: chunks in use plus mmapped blocks
    (glibc's ``mallinfo2``: uordblks + hblkhd); None where it is missing (not glibc, or glibc < 2.33)."""
    from hfzero.profiler.allocator import load_mallinfo2

    mallinfo2 = load_mallinfo2()
    if mallinfo2 is None:
        return None
    info = mallinfo2()
    return int(info.uordblks + info.hblkhd)
