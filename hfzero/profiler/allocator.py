"""Allocator statistics behind one device-agnostic helper, ``AllocatorProbe``.

The probe only reads counters: it never resets peak statistics and never empties a cache (see
STYLE.md, "side effects in observers"). Two costs:

- ``sample()`` is cheap and runs at every phase boundary. CUDA: one
  ``torch.cuda.memory_stats_as_nested_dict`` call (allocated / reserved / active / inactive-split
  bytes, allocation retries, OOMs, lifetime peaks). CPU: the process RSS from ``/proc/self/statm``
  (one pread) and glibc ``mallinfo2()`` through ctypes (heap arena, in-use, free, keepcost and
  mmapped bytes; it walks the heap's free lists, ~0.1 ms with thousands of free chunks).
- ``snapshot()`` is expensive (it walks every segment and block of the CUDA caching allocator) and
  runs only when the profiler was asked for it, at most once per step. CPU has no equivalent: it
  returns None there.

Fragmentation is computed by pure functions so it can be tested on recorded data: at every sample,
``split_fragmentation`` on CUDA (free blocks inside segments in use / reserved, from the counters) and
``heap_fragmentation`` on CPU (free-but-held fraction of the malloc heap, fordblks / arena), both in
profiler/fragmentation.py; with a snapshot, ``cuda_snapshot_summary`` (1 - largest free block / total free,
over the caching allocator's segments).
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from hfzero.devices import with_index
from hfzero.logging import get_logger
from hfzero.profiler.fragmentation import heap_fragmentation, split_fragmentation

logger = get_logger(__name__)

AllocatorSample = dict[str, Any]


@dataclasses.dataclass(frozen=True)
class MallInfo:
    """The fields of glibc's ``struct mallinfo2`` the profiler records (all in bytes).

    Attributes:
        arena: non-mmapped bytes the heap holds from the OS (all arenas).
        hblkhd: bytes in mmapped chunks (large allocations, e.g. most CPU tensors).
        uordblks: bytes of the heap in use.
        fordblks: bytes of the heap free but held (reusable without asking the OS).
        keepcost: releasable bytes at the top of the main heap.
    """

    arena: int
    hblkhd: int
    uordblks: int
    fordblks: int
    keepcost: int


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


def cpu_fields(rss: int | None, info: MallInfo | None, rss_peak: int | None = None) -> AllocatorSample:
    """The allocator record of a CPU rank from its RSS and mallinfo2 figures (None where unavailable).

    ``allocated`` is heap in use plus mmapped chunks, ``reserved`` the heap arena plus mmapped chunks.
    """
    if info is None:
        heap: AllocatorSample = dict.fromkeys(
            ("allocated", "reserved", "heap_arena", "heap_in_use", "heap_free", "heap_keepcost", "heap_mmapped",
             "fragmentation"))
    else:
        heap = {
            "allocated": info.uordblks + info.hblkhd,
            "reserved": info.arena + info.hblkhd,
            "heap_arena": info.arena,
            "heap_in_use": info.uordblks,
            "heap_free": info.fordblks,
            "heap_keepcost": info.keepcost,
            "heap_mmapped": info.hblkhd,
            "fragmentation": heap_fragmentation(info.arena, info.fordblks),
        }
    return {"rss": rss, "rss_peak": rss_peak, **heap}


def cuda_fields(stats: Mapping[str, Any], rss: int | None) -> AllocatorSample:
    """The allocator record of a CUDA rank from ``torch.cuda.memory_stats_as_nested_dict()``; ``fragmentation``
    is ``split_fragmentation`` (inactive split bytes / reserved bytes).

    (The nested form is what ``torch.cuda.memory_stats()`` flattens into "allocated_bytes.all.current"
    keys; reading it directly skips that flattening of ~150 entries at every phase boundary.)
    """
    def all_pools(name: str, which: str = "current") -> int:
        return int(stats.get(name, {}).get("all", {}).get(which, 0))

    allocated, reserved = all_pools("allocated_bytes"), all_pools("reserved_bytes")
    return {
        "rss": rss,
        "allocated": allocated,
        "reserved": reserved,
        "active": all_pools("active_bytes"),
        "inactive_split": all_pools("inactive_split_bytes"),
        "reserved_unallocated": reserved - allocated,
        "num_alloc_retries": int(stats.get("num_alloc_retries", 0)),
        "num_ooms": int(stats.get("num_ooms", 0)),
        "peak_allocated": all_pools("allocated_bytes", "peak"),
        "peak_reserved": all_pools("reserved_bytes", "peak"),
        "fragmentation": split_fragmentation(all_pools("inactive_split_bytes"), reserved),
    }


def cuda_snapshot_summary(snapshot: Sequence[Mapping[str, Any]] | Mapping[str, Any],
                          device_index: int | None = None) -> dict[str, Any]:
    """Summarize a ``torch.cuda.memory_snapshot()`` (the list of segments, or a dict with "segments").

    Per segment: ``total``, ``allocated``, ``free`` (the sum of its inactive blocks, which the caching
    allocator keeps coalesced) and ``largest_free`` (its largest inactive block). Overall:
    ``reserved``, ``allocated``, ``total_free``, ``largest_free_block``, ``reserved_unallocated``
    (reserved minus allocated, which also counts blocks freed but pending a stream event) and
    ``fragmentation`` = 1 - largest_free_block / total_free (0.0 when nothing is free: no free memory
    can be fragmented). Segments of other devices are skipped when ``device_index`` is given.
    """
    segments = snapshot["segments"] if isinstance(snapshot, Mapping) else snapshot
    rows = []
    for segment in segments:
        if device_index is not None and segment.get("device", device_index) != device_index:
            continue
        free_blocks = [b["size"] for b in segment.get("blocks", ()) if b["state"] == "inactive"]
        rows.append({"total": segment["total_size"], "allocated": segment["allocated_size"],
                     "free": sum(free_blocks), "largest_free": max(free_blocks, default=0)})
    reserved = sum(r["total"] for r in rows)
    allocated = sum(r["allocated"] for r in rows)
    total_free = sum(r["free"] for r in rows)
    largest = max((r["largest_free"] for r in rows), default=0)
    return {
        "reserved": reserved,
        "allocated": allocated,
        "total_free": total_free,
        "largest_free_block": largest,
        "reserved_unallocated": reserved - allocated,
        "fragmentation": 1.0 - largest / total_free if total_free else 0.0,
        "segments": rows,
    }


def _close_descriptors(descriptors: list[int | None]) -> None:
    for descriptor in descriptors:
        if descriptor is not None:
            os.close(descriptor)


class AllocatorProbe:
    """Reads allocator statistics of one device; the device type is decided here and nowhere else.

    CUDA devices get the caching allocator's counters; every other device gets the host figures
    (RSS and the malloc heap), which is where a CPU rank's tensors live.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = with_index(device)  # See [Note: device index] in hfzero/devices.py
        self._is_cuda = device.type == "cuda"
        self._page_size = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
        self._mallinfo2 = load_mallinfo2() if not self._is_cuda else None
        try:  # kept open: one pread per sample instead of open/read/close
            self._statm: int | None = os.open("/proc/self/statm", os.O_RDONLY)
        except OSError:
            self._statm = None
        try:  # VmHWM: the process's lifetime peak RSS (read only, never reset)
            self._status: int | None = None if self._is_cuda else os.open("/proc/self/status", os.O_RDONLY)
        except OSError:
            self._status = None
        # a probe dropped without close() (a profiler never stopped) closes them when collected
        self._closer = weakref.finalize(self, _close_descriptors, [self._statm, self._status])

    def sample(self) -> AllocatorSample:
        """Cheap counters of the allocator now (see the module docstring for what each costs)."""
        if self._is_cuda:
            fields = cuda_fields(torch.cuda.memory_stats_as_nested_dict(self.device), self._rss())
        else:
            fields = cpu_fields(self._rss(), self._read_mallinfo(), self._rss_peak())
        return {"device": str(self.device), **fields}

    def close(self) -> None:
        """Release the /proc file descriptors (sampling afterwards falls back to psutil)."""
        self._closer()
        self._statm = self._status = None

    def snapshot(self) -> dict[str, Any] | None:
        """Fragmentation from a full CUDA allocator snapshot (expensive); None on other devices."""
        if not self._is_cuda:
            return None
        try:  # include_traces (torch >= 2.11) skips the stack traces we do not record
            segments = torch.cuda.memory_snapshot(include_traces=False)
        except TypeError:
            segments = torch.cuda.memory_snapshot()
        return cuda_snapshot_summary(segments, self.device.index)

    def _rss(self) -> int | None:
        if self._statm is not None:
            try:
                return int(os.pread(self._statm, 256, 0).split()[1]) * self._page_size
            except (OSError, IndexError, ValueError):
                pass
        try:
            import psutil
        except ImportError:
            return None
        return int(psutil.Process().memory_info().rss)

    def _rss_peak(self) -> int | None:
        if self._status is None:
            return None
        try:
            text = os.pread(self._status, 4096, 0).decode("ascii", "replace")
            line = next(line for line in text.splitlines() if line.startswith("VmHWM:"))
            return int(line.split()[1]) * 1024
        except (OSError, StopIteration, ValueError, IndexError):
            return None

    def _read_mallinfo(self) -> MallInfo | None:
        if self._mallinfo2 is None:
            return None
        raw = self._mallinfo2()
        return MallInfo(arena=raw.arena, hblkhd=raw.hblkhd, uordblks=raw.uordblks, fordblks=raw.fordblks,
                        keepcost=raw.keepcost)


def load_mallinfo2() -> Any:
    """glibc's ``mallinfo2`` (glibc >= 2.33) as a ctypes function, or None where it is missing."""
    try:
        libc = ctypes.CDLL(None)
        function = libc.mallinfo2
    except (OSError, AttributeError):
        logger.debug("mallinfo2 is not available; heap fields will be null")
        return None
    function.restype = _MallInfo2
    function.argtypes = []
    return function
