"""How the host allocator is configured for CPU ranks: a fixed glibc mmap threshold, and the heap's
free pages handed back to the system after every optimizer step.

[Note: host allocator]
A CPU rank's tensors come from glibc malloc. glibc raises its mmap threshold to the size of every
mmapped block freed (up to 32 MiB), after which allocations below that size come from the heap,
which fragments and never shrinks. A training step frees many blocks of a few MiB (activations,
optimizer temporaries, staging), so the threshold climbs in the first steps and the process's peak
RSS then grows step after step (measured: GPT-2 5.3M parameters, world 2, stage 3, peak +12 to +23%
from step 2 to step 12 with glibc's default; flat with a fixed threshold). Pooling hfzero's own
buffers (stage-3 gather buffers, stage-2 staging) removes the largest churn but not torch's own
(activations, optimizer temporaries).

So on a CPU engine ``prepare`` sets ``M_MMAP_THRESHOLD`` to ``ZeroConfig.host_mmap_threshold``
(default 1 MiB) through ``mallopt``, which also turns the dynamic raise off: blocks of 1 MiB and more
are mapped and unmapped with their tensor (RSS follows live memory), smaller ones use the heap.
Measured at 5.3M parameters: 131072 and 1 MiB are both flat, 1 MiB the faster; 8 MiB still grows
(+3 to +6%). It is process-wide, done once per process, logged, and skipped when the user decided
already (``MALLOC_MMAP_THRESHOLD_`` in the environment), when ``host_mmap_threshold`` is 0, on CUDA
engines (the caching allocator has its own pools) and where ``mallopt`` is missing (not glibc).

The threshold is not enough with several backward passes per step. Blocks below it (activations of a
few hundred KiB, interleaved with small long-lived C++ objects) still fragment the heap: the bytes in
use stay flat (mallinfo2: +0.1 MB per step) while the heap grows by the free space it cannot reuse
(measured: GPT-2 5.3M, world 2, stage 3, 4 micro-batches per step: +10 MB of peak RSS per step, +13%
after 8 steps). So after every optimizer step a CPU engine calls ``malloc_trim(0)``, which returns
every free page of every arena to the system (not only the heap's top), and the next step starts from
the memory in use (same run: +2% after 8 steps, flat after the first ones). It costs a walk over the
heap once per step (``host_trim``): 2.7 ms per call there, step time x1.015 against the trim off, peak
growth over 10 steps 1.02 against 1.12-1.17 (benchmarks/host_trim.py). A lower threshold (128 KiB) is
flat too but maps and zero-fills every activation block each time (8 steps: 10.6 s against 6.0 s,
one run each on a shared machine).
"""

from __future__ import annotations

import ctypes
import os
from typing import Any

from hfzero.logging import get_logger

logger = get_logger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MAX_MMAP_THRESHOLD = 1 << 25
"""glibc's largest mmap threshold on 64-bit systems (HEAP_MAX_SIZE / 2), the ceiling of its dynamic one."""
_NO_TOP_TRIM = 2**31 - 1
_applied: int | None = None
_malloc_trim: Any = None  # libc's malloc_trim once looked up; False where there is none


def configure_host_allocator(threshold: int) -> bool:
    """Fix glibc's mmap threshold at ``threshold`` bytes and turn its automatic trim of the heap's top
    off (see [Note: host allocator]); True if set now or earlier in this process."""
    global _applied
    if threshold <= 0 or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    if _applied == threshold:
        return True
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        logger.debug("mallopt is not available (not glibc); host allocator left as it is")
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    if mallopt(_M_MMAP_THRESHOLD, int(threshold)) != 1:
        logger.warning("mallopt(M_MMAP_THRESHOLD, %d) failed; host allocator left as it is", threshold)
        return False
    if "MALLOC_TRIM_THRESHOLD_" not in os.environ and mallopt(_M_TRIM_THRESHOLD, _NO_TOP_TRIM) != 1:
        logger.warning("mallopt(M_TRIM_THRESHOLD) failed; glibc trims the heap's top itself")
    _applied = threshold
    logger.info("host allocator: glibc mmap threshold fixed at %d bytes, no automatic trim of the heap's top "
                "(ZeroConfig.host_mmap_threshold; see [Note: host allocator])", threshold)
    return True


def resident_bytes() -> int | None:
    """The process's resident memory (RSS) now, from /proc/self/statm; None where there is no /proc."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, IndexError, ValueError):
        return None


_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def trim_host_heap() -> bool:
    """Hand the heap's free pages back to the system (glibc ``malloc_trim(0)``), as a CPU engine does
    after every optimizer step (see [Note: host allocator]). True if memory was released; False when
    there was none to release or ``malloc_trim`` is missing (not glibc)."""
    global _malloc_trim
    if _malloc_trim is None:
        try:
            _malloc_trim = ctypes.CDLL(None).malloc_trim
            _malloc_trim.argtypes = [ctypes.c_size_t]
            _malloc_trim.restype = ctypes.c_int
        except (OSError, AttributeError):
            logger.debug("malloc_trim is not available (not glibc); host heap left as it is")
            _malloc_trim = False
    return bool(_malloc_trim) and _malloc_trim(0) == 1


class HeapTrimmer:
    """Decides, after each optimizer step of a CPU engine, whether to trim the host heap (see
    [Note: host allocator]): when the resident memory after the step exceeds the settled level (the
    resident memory after the first step, and after the first step following each trim) by more than
    ``slack`` of it; ``slack`` 0 trims after every step. Holds nothing but two integers; the check reads
    /proc/self/statm once per step."""

    def __init__(self, slack: float):
        self.slack = slack
        self.settled: int | None = None
        self.trims = 0
        """How many times the heap was trimmed (tests and benchmarks read it)."""

    def after_step(self) -> bool:
        """Trim if the heap grew past the bound; True if it trimmed."""
        if self.slack > 0:
            rss = resident_bytes()
            if rss is None:
                return False
            if self.settled is None:
                self.settled = rss
                return False
            if rss <= self.settled * (1 + self.slack):
                return False
            logger.debug("host heap: resident %d bytes after the step, settled at %d: trimming", rss, self.settled)
            self.settled = None  # the next step, refilling the heap it reuses, settles it again
        self.trims += 1
        return trim_host_heap()
