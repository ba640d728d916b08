"""How the host allocator is configured for CPU ranks: a fixed glibc mmap threshold, and the heap's
free pages handed back to the system after the optimizer step (every step, or when the resident memory
grew past a slack).

[Note: host allocator]
A CPU rank's tensors come from glibc malloc. By default glibc raises its mmap threshold to the size of
every mmapped block freed (up to 32 MiB, its ceiling on 64-bit systems) and its trim threshold to twice
that: blocks below the threshold come from the heap, whose top is handed back to the system whenever
more than the trim threshold lies free there. A training step allocates and frees the same few hundred
MB every step, and the two ways to serve it trade time against memory:
- every block that is mapped, and every heap page handed back, is faulted in and zero-filled again at
  its next use: that is the step-time cost, counted in page faults below;
- blocks kept in the heap fragment it, and the resident memory then grows step after step by space the
  heap does not reuse (glibc's defaults at issue 14: stage 3, peak +12 to +27% from step 2 to 12).

The default (``host_mmap_threshold`` 1 MiB, ``host_trim`` after every step, ``host_trim_slack`` 0) maps
every block of 1 MiB or more and returns the heap's free pages after each step: the lowest and flattest
peak measured, at the price of mapping every large activation block each step (the issue-21 bars: step
x1.69 / 1.38 / 1.46 of DDP at stages 1 / 2 / 3, stage 1 1074 ms against 704 with glibc's defaults).
``prepare`` sets it through ``mallopt`` (process-wide, once per process, logged; skipped with
``MALLOC_MMAP_THRESHOLD_`` in the environment, a threshold of 0, on CUDA engines, whose caching
allocator has its own pools, and where ``mallopt`` is missing, not glibc).

The fast policy (``host_mmap_threshold=33554432, host_trim_slack=0.02``) fixes the threshold at glibc's
ceiling, where its dynamic one ends up anyway, turns glibc's own top trim off, and lets ``HeapTrimmer``
call ``malloc_trim(0)`` only when the resident memory after a step exceeds the settled level by more
than the slack. Its steady step faults no more pages than plain torch (tests/test_host_policy.py: 0
per step against 9,600 with glibc's defaults and 14,600 with the default policy, world 1) and its peak
at the bars shape is DDP's, but it is NOT the default: with several backward passes per step (stage 3,
4 micro-batches) the heap fragments and its peak grows 8-9% over 12 steps and stands above DDP's, and
tests/test_memory_flat.py's stage-2 run grew 5.3% (bound 5%). Trimming does not cure that growth (each
trim also refaults the heap), pooling hfzero's own per-micro-batch buffers is the likely cure (undone).

Measured with benchmarks/host_policy.py (each variant in its own processes, GPT-2 5.3M, world 2, one
round each on a machine at load 18-30 on 2 cores, so wall times are noise: CPU seconds and page faults
per step of the busier rank, per-rank peak RSS, growth = peak after the last step / after step 2):

  bars: batch 8 x 128, 8 steps     cpu s  faults  peak MB  growth   accum: 2 x 64, 4 micro, stage 3, 12 steps
  DDP                               1.60-1.68  33-35k  853-882  1.05-1.07   DDP                1.06  9.7k  630  1.027
  stage 1 default (1 MiB, trim)     1.86-1.94  148k    715      1.002       default            1.52  108k  569  1.031
  stage 1 glibc defaults            1.64       38k     889      1.055       32 MiB, no trim    1.21  14k   941  1.459
  stage 1 32 MiB, no trim           1.65       33k     883      1.025       32 MiB + 2% trim   1.29  31k   695  1.084
  stage 1 32 MiB + 2% trim          1.67       62k     857      1.012       8 MiB + 2% trim    1.36  55k   638  1.088
  stage 1 8 MiB + 2% trim           1.74       64k     840      1.041
(the 2%-trim rows ran an earlier trimmer that re-settled lower after each trim; the settled level is
now only raised after a trim. With it, at load 8-11: stage 1 bars 1.55 s, 63k faults, 3 trims, peak 852
MB, growth 1.026; accum 1.16 s, 16k faults, 4 trims, peak 697 MB, growth 1.068: the early trims still
refault the heap, and the accumulation peak stays ~10% above DDP's.) The default policy, same code
(fused AdamW included) in tests/test_memory_flat.py's runs: peak growth from step 2 to the last 1.013 at most.
"""

from __future__ import annotations

import ctypes
import os
from typing import Any

from hfzero.logging import get_logger

logger = get_logger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_NO_TOP_TRIM = 2**31 - 1  # mallopt's int: above any heap top a rank frees
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_applied: int | None = None
_malloc_trim: Any = None  # libc's malloc_trim once looked up; False where there is none


def configure_host_allocator(threshold: int, top_trim: bool = True) -> bool:
    """Fix glibc's mmap threshold at ``threshold`` bytes, and with ``top_trim`` False turn glibc's
    automatic trim of the heap's top off (see [Note: host allocator]); True if set now or earlier in
    this process."""
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
    if not top_trim and "MALLOC_TRIM_THRESHOLD_" not in os.environ and mallopt(_M_TRIM_THRESHOLD, _NO_TOP_TRIM) != 1:
        logger.warning("mallopt(M_TRIM_THRESHOLD) failed; glibc trims the heap's top itself")
    _applied = threshold
    logger.info("host allocator: glibc mmap threshold fixed at %d bytes%s (ZeroConfig.host_mmap_threshold; "
                "see [Note: host allocator])", threshold, "" if top_trim else ", no automatic trim of the heap's top")
    return True


def resident_bytes() -> int | None:
    """The process's resident memory (RSS) now, from /proc/self/statm; None where there is no /proc."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, IndexError, ValueError):
        return None



def trim_host_heap() -> bool:
    """Hand the heap's free pages back to the system (glibc ``malloc_trim(0)``), as a CPU engine does
    after an optimizer step when its ``HeapTrimmer`` says so (see [Note: host allocator]). True if memory was released; False when
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
