"""How the host allocator is configured for CPU ranks: glibc's mmap threshold fixed at its ceiling with
no automatic trim of the heap's top, and the heap's free pages handed back to the system after an
optimizer step only when the resident memory grew.

[Note: host allocator]
A CPU rank's tensors come from glibc malloc. By default glibc raises its mmap threshold to the size of
every mmapped block freed (up to 32 MiB, its ceiling on 64-bit systems) and its trim threshold to twice
that: blocks below the threshold come from the heap, whose top is handed back to the system whenever
more than the trim threshold lies free there. Both matter to a training step, which allocates and frees
the same few hundred MB of activations, gradients and temporaries every step:
- every block that is mapped (at or above the threshold), and every page of the heap's top that glibc
  handed back, is faulted in and zero-filled again at its next use: that is the step-time cost. A
  fixed 1 MiB threshold with ``malloc_trim(0)`` after every step (hfzero before issue 21) mapped every
  activation block of 1 MiB or more each step: x1.5 the step time of the same engine with glibc's
  defaults (GPT-2 5.3M, batch 8 x 128 per rank, world 2, stage 1: 1074 against 704 ms, 10x the page
  faults). glibc's own top trim still refaults part of the heap on some steps (a world-1 stage-1 step
  of tests/test_host_policy.py: 2,000 to 10,000 faults per step, plain torch as well).
- blocks kept in the heap fragment it: the resident memory then grows step after step by free space
  the heap cannot reuse (GPT-2 5.3M, world 2, stage 3 with glibc's defaults and fresh gather storage:
  peak +12 to +27% from step 2 to 12; stage 3 with 4 micro-batches per step: ~10 MB per step).

So on a CPU engine ``prepare`` fixes the mmap threshold at ``ZeroConfig.host_mmap_threshold`` (default
32 MiB: where glibc's dynamic one ends up, reached from the first step) and turns the automatic top
trim off (``mallopt``; process-wide, done once per process, logged; skipped when the user decided
already, ``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_`` in the environment, when the threshold
is 0, on CUDA engines, whose caching allocator has its own pools, and where ``mallopt`` is missing,
not glibc). A steady step then reuses the heap's pages and faults none (the same world-1 step: 0).
Growth is handled after the optimizer step, when the step's transient memory is free: ``HeapTrimmer``
reads the resident memory (/proc/self/statm) and calls ``malloc_trim(0)``, which returns every free
page of every arena, only when it exceeds the settled level (after the first step, and after the first
step following each trim) by more than ``host_trim_slack`` (2%). A trim costs the next step a refault
of the heap's free pages, so it must be rare: a steady run settles and never trims again, a fragmenting
one trims once the growth reaches the slack, which bounds the peak's growth. hfzero's own large
buffers are pooled (stage-3 gather buffers, stage-2 staging) and allocate nothing per step.

FIGURES
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
    [Note: host allocator]): when the resident memory after the step exceeds the settled level by more
    than ``slack`` of it; ``slack`` 0 trims after every step. The settled level is the resident memory
    after the first step, raised (never lowered) to the resident memory after the step that follows each
    trim: a trim hands back pages the next steps fault in again, and a working set that really grew
    (a longer sequence, say) must not be trimmed every step. Holds a few integers; the check reads
    /proc/self/statm once per step."""

    def __init__(self, slack: float):
        self.slack = slack
        self.settled: int | None = None
        self._resettle = False
        self.trims = 0
        """How many times the heap was trimmed (tests and benchmarks read it)."""

    def after_step(self) -> bool:
        """Trim if the heap grew past the bound; True if it trimmed."""
        if self.slack > 0:
            rss = resident_bytes()
            if rss is None:
                return False
            if self.settled is None or self._resettle:
                self.settled = rss if self.settled is None else max(self.settled, rss)
                self._resettle = False
                return False
            if rss <= self.settled * (1 + self.slack):
                return False
            logger.debug("host heap: resident %d bytes after the step, settled at %d: trimming", rss, self.settled)
            self._resettle = True
        self.trims += 1
        return trim_host_heap()
