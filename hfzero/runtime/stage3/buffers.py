"""Each stage-3 unit's full buffer: one storage for the unit's lifetime, memory only while gathered.

[Note: stage-3 gather buffers]
A unit's parameters are views of its full buffer while gathered, and autograd saves views of them in a
training forward (``weight.t()`` in a linear layer). Those saved views hold the buffer's storage object
(not the tensor), so three things must hold at once, with public torch API only:
1. release gives the memory back although saved views still reference the storage, and they lose it
   too (nothing keeps a released unit resident);
2. the backward gather refills the *same* storage the saved views reference, before any of them is read;
3. gathering and releasing every unit twice per step does not churn an allocator: on the host, glibc
   hands a freed block to the activations allocated meanwhile, the next gather takes a fresh one and the
   heap grows step after step (ZeRO-R's MD problem: +12 to +27% peak over 12 steps at issue 14).

Only the storage's own memory can change under a live storage object: publicly by ``resize_`` (through
the allocator the storage was made with) or, for memory hfzero maps itself, by handing its pages back to
the kernel. So a unit's storage is made once, at construction, and never replaced, and one of two
backings serves it (``GatherBuffers.kind``, ``ZeroConfig.stage3_buffers``):

- "mapped" (opt-in, CPU ranks on Linux): the storage wraps an anonymous private mapping of the unit's size that
  hfzero owns (``mmap``, ``torch.frombuffer``). Release is ``madvise(MADV_DONTNEED)``: the kernel takes
  the physical pages back at once (the process's resident memory drops by the unit) and the address
  range stays the unit's; the next gather's writes fault zero-filled pages in. No allocator is ever
  called after construction, so nothing fragments: the mapping is the unit's for its lifetime, no other
  allocation can land in it, and the host's peak counts gathered units only (nothing idle stays
  resident). A view kept past release reads zeros until the next gather refills it, never another
  unit's values or freed memory. The cost is the page faults of each gather (one per 4 KiB page touched;
  docs/stage3.md has measured figures: benchmarks/stage3_buffers.py).
- "resized" (the default, every device): release resizes the storage to 0 bytes and a gather resizes it
  back (FSDP1's and FSDP2's technique); saved views then see a 0-byte storage until the gather refills it (nothing
  reads them meanwhile: torch does not check a tensor against its storage's size, so a read would touch memory that
  is not there, which is also why a released unit's parameters point at a 0-element tensor). On CUDA the memory
  comes from the caching allocator, which is the pool: a block freed by a release is reused by the next allocation
  of its size on the same stream, with no ``cudaMalloc`` after the first step. On the host it is glibc: item 3
  holds only as far as glibc reuses the freed block (tests/test_memory_flat.py checks the peak stays flat over 12
  steps; it does, within 2%).

Why "resized" is the default on the host too (wave 4): measured side by side, it is the faster backing
and its host peak is no higher. On 2 CPU ranks with a 5.3M GPT-2, every parameter partitioned
(benchmarks/stage3_buffers.py), "mapped" took 13% more step time than "resized" for the same peak (953 against
949 MB); on the host-overhead proxy (benchmarks/host_proxy.py, rank 0 of a fake world of 8) stage 3 cost
1.20-1.31 x a plain loop's host time with "mapped" and 1.07-1.27 x with "resized". A mapped gather faults in
every page of the unit (the kernel zeroes each) and each release is a ``madvise`` system call; ``resize_``
hands glibc a block it reuses warm. "resized" is also a CUDA rank's path, so the CPU figures speak for the
GPU's. What "mapped" still gives: resident memory between steps lower by the released units (glibc keeps
freed blocks resident for reuse). tests/test_stage3_gather_buffers.py trains both identically.

Stream order on CUDA ("resized"): the hooks run on the compute stream, so a gather's ``resize_`` takes a
block of the compute stream's pool, and ProcessGroupNCCL makes its stream wait for the compute stream
before the all-gather writes the block: every kernel that read the block's previous contents (another
unit's parameters, an activation) was enqueued on the compute stream before the gather and runs first.
A release happens after the unit's wait (the compute stream waited for the all-gather) and after the
compute kernels that read the parameters were enqueued, so the freed block's next user, again a
compute-stream allocation, is ordered after them. No ``record_stream`` and no host synchronization: the
ordering is the streams' own, as with any block the caching allocator reuses.
"""

from __future__ import annotations

import mmap
import sys

import torch

from hfzero.config import ConfigError
from hfzero.logging import get_logger

logger = get_logger(__name__)

MAPPED = "mapped"
RESIZED = "resized"


def mapped_supported(device: torch.device) -> bool:
    """Whether units on ``device`` can use the "mapped" backing: a CPU device on Linux, whose
    ``madvise(MADV_DONTNEED)`` frees a private mapping's pages at once (see [Note: stage-3 gather buffers])."""
    return (device.type == "cpu" and sys.platform.startswith("linux") and hasattr(mmap, "MAP_PRIVATE")
            and hasattr(mmap, "MADV_DONTNEED") and hasattr(mmap.mmap, "madvise"))


class UnitBuffer:
    """One unit's full buffer (``tensor``, flat, ``numel`` elements); see [Note: stage-3 gather buffers].

    Memory: ``nbytes`` while acquired (PARAM_GATHERED), none between a release and the next acquire.
    """

    kind = RESIZED

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device):
        self.tensor = torch.empty(numel, dtype=dtype, device=device)
        self.nbytes = numel * self.tensor.element_size()
        self._storage = self.tensor.untyped_storage()

    def acquire(self) -> None:
        """Give the storage its memory (contents undefined) before a gather writes it."""
        self._storage.resize_(self.nbytes)

    def release(self) -> None:
        """Take the memory away: the storage (and every view of it) has 0 bytes until ``acquire``."""
        self._storage.resize_(0)


class MappedUnitBuffer(UnitBuffer):
    """A unit's full buffer on a private anonymous mapping: ``acquire`` does nothing (a gather's writes
    fault pages in), ``release`` hands the pages back to the kernel (``MADV_DONTNEED``)."""

    kind = MAPPED

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device):
        element = torch.empty(0, dtype=dtype).element_size()
        self.nbytes = numel * element
        length = -(-self.nbytes // mmap.PAGESIZE) * mmap.PAGESIZE
        self._map = mmap.mmap(-1, length, flags=mmap.MAP_PRIVATE)
        self.tensor = torch.frombuffer(self._map, dtype=dtype, count=numel)  # keeps the mapping alive

    def acquire(self) -> None:
        pass

    def release(self) -> None:
        self._map.madvise(mmap.MADV_DONTNEED)


class GatherBuffers:
    """Makes every unit's full buffer on one device and says which backing they use.

    ``kind``: "mapped" or "resized" (see [Note: stage-3 gather buffers]). Holds no memory itself.
    """

    def __init__(self, dtype: torch.dtype, device: torch.device, kind: str = RESIZED):
        self.dtype = dtype
        self.device = device
        self.kind = kind
        if kind not in (MAPPED, RESIZED):
            raise ConfigError(f'stage 3: unit buffers are "{RESIZED}" or "{MAPPED}", not {kind!r}')
        if kind == MAPPED and not mapped_supported(device):
            raise ConfigError(f'stage3_buffers="mapped" needs a CPU device on Linux (madvise), not {device} on '
                              f'{sys.platform}; use stage3_buffers="resized" (the default)')
        logger.debug("stage 3: %s gather buffers on %s", self.kind, device)

    def make(self, numel: int) -> UnitBuffer:
        """A unit's buffer of ``numel`` elements, acquired: the caller takes its views (torch checks a view
        against the storage's size), then releases it until the first gather."""
        if self.kind == MAPPED and numel > 0:
            return MappedUnitBuffer(numel, self.dtype, self.device)
        return UnitBuffer(numel, self.dtype, self.device)
