"""How the host allocator is configured for CPU ranks, when a user asks for it: a fixed glibc mmap
threshold, and the heap's free pages handed back to the system after the optimizer step (every step,
or when the resident memory grew past a slack). By default glibc is left alone.

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

Issue 21 measured what the old default (``host_mmap_threshold`` 1 MiB, ``host_trim`` after every step)
cost: step x1.69 / 1.38 / 1.46 of DDP at stages 1 / 2 / 3 on the bars shape (GPT-2 5.3M, batch 8 x 128,
world 2), 148k page faults per step against DDP's 33k, for a peak 0.8x DDP's. The growth it was
chosen against (issue 14) came largely from hfzero's own allocations: the reducer freed and
reallocated gradient staging buffers of 1-8 MiB several times per backward pass at stage 3 (171
fresh buffers in 240 takes, 69 MB per step with 4 micro-batches), blocks that land between activation
blocks in the heap. They are now pooled ([Note: staging pool] in reducer.py: 6 allocations in the
first pass, none after), like stage 3's gather buffers, so hfzero allocates nothing per step, and
**the default leaves glibc alone** (``host_mmap_threshold`` 0, ``host_trim`` False): torch's own
allocations behave exactly as under DDP. Measured with the pool, rank 0 / 1 (tests/test_memory_flat.py
shapes, batch 2 x 64, world 2, and the bars shape with benchmarks/host_policy.py):

  glibc defaults, hfzero pooled           peak MB    growth (last / step 2)    faults/step
  stage 3, 4 micro-batches, 16 steps      588 / 599  1.019 / 1.031             16k
  stage 3, 4 micro-batches, DDP           601 / 597  1.031 / 1.035             0.2-4k
  stage 2, 1 micro-batch, 12 steps        571 / 570  1.042 / 1.038             5k
  stage 2, 1 micro-batch, DDP             576 / 587  1.029 / 1.014             0
  bars: stage 1 / 2 / 3, 10 steps         831 / 852 / 845 (worse rank)          33-38k
  bars: DDP                               839                                   33k
  benchmarks/host_policy.py, bars, 3 interleaved rounds, CPU time and peak as x DDP:
    stage 1 / 2 / 3: CPU 1.019 / 0.985 / 0.986, peak 1.024 / 1.037 / 1.011, faults 34-37k (DDP 37k)
    1 MiB + trim every step (stage 1): CPU 1.109, peak 0.825, faults 149k

The peak is DDP's within a few percent (1-4% above it in the interleaved benchmark, although the
model states are smaller: not explained yet, see docs/engine.md) and creeps a few MB over the first steps as glibc's dynamic mmap threshold
settles, as DDP's does; tests/test_memory_flat.py measures growth from step 3. The lowest peak is
still available where memory, not time, is short: ``host_mmap_threshold=1048576, host_trim=True``
maps every block of 1 MiB or more and trims after every step (bars: peak 0.8x DDP's, step ~1.5x).
``prepare`` applies a nonzero threshold through ``mallopt`` (process-wide, once per process, logged;
skipped with ``MALLOC_MMAP_THRESHOLD_`` in the environment, on CUDA engines, whose caching allocator
has its own pools, and where ``mallopt`` is missing, not glibc).

Also measured and not chosen: 32 MiB fixed threshold with a trim when the resident memory grew past
2% (``host_mmap_threshold=33554432, host_trim_slack=0.02``): as few faults as DDP, but before the
staging pool its peak grew 8-9% over 12 steps with 4 micro-batches; glibc defaults with a trim after
every step: 84k faults per step on the bars shape (the trimmed pages fault in again), peak 0.9x DDP's.
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
