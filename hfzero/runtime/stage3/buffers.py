"""Reused gather buffers for stage 3: units borrow pre-allocated storage instead of allocating per gather.

[Note: stage-3 gather buffers]
Gathering a unit into fresh storage and freeing it after every use (twice per step per unit) churns
the allocator with the largest transient allocations of the run. On the host, glibc then raises its
mmap threshold to the size of the freed block and serves later allocations of up to that size from
a heap that never shrinks: the process's peak grew with every step (ZeRO-R's MD problem). On CUDA
the caching allocator's reserved memory grows the same way. So a unit borrows a buffer from a
``GatherBufferPool`` for each gather and gives it back on release; in steady state the same few
buffers serve every gather of every step.

How a borrowed buffer keeps [Note: stage-3 release] (in unit.py) true: the unit's full tensor keeps
its own storage object, whose memory is *swapped* with the pool buffer's
(``UntypedStorage._swap_data_ptr_``: the two storage objects exchange their allocations and sizes).
Views autograd saved in forward share the unit's storage object, so on release (swapped back: the
unit's storage has 0 bytes again) they lose their memory exactly as a resize to 0 would, and the
backward gather swaps a buffer in and refills it before any of them is read. A buffer is lent to one
unit at a time; on CUDA a collective launched into a reused buffer is ordered after the compute
stream's earlier kernels (the collective stream waits for the current stream), as with a freed and
reallocated block of the caching allocator.

Buffers are matched by exact size (decoder blocks share one size, the root has its own), so a large
buffer is never tied up by a small unit. The pool keeps idle buffers while everything it holds
stays within ``limit_bytes``: the root unit, the largest unit and the next one or the prefetch budget,
the most that can be gathered at once (``config.stage3_gathered_numel``) (see [Note: stage-3 gather order] in scheduler.py); a buffer given back
beyond that is freed.
"""

from __future__ import annotations

import torch


class GatherBufferPool:
    """Storages lent to stage-3 units for their gathers; see [Note: stage-3 gather buffers].

    Memory: ``lent_bytes()`` are gathered units (PARAM_GATHERED), ``idle_bytes()`` are buffers kept
    for the next gathers (COMM_BUFFER); both transient, bounded by ``limit_bytes``.
    """

    def __init__(self, dtype: torch.dtype, device: torch.device, limit_bytes: int = 0):
        self.dtype = dtype
        self.device = device
        self.limit_bytes = limit_bytes
        """Most bytes held (idle + lent) after a give-back; larger holdings free the returned buffer."""
        self._idle: dict[int, list[torch.UntypedStorage]] = {}
        self._lent = 0
        self.allocations = 0
        """Buffers allocated since construction (steady state: constant)."""
        self.served = 0
        """Gathers given memory by the pool since construction, from an idle buffer or a new one. With
        ``allocations``, the counters the GPU check reads (``hfzero.testing.fake_world.pool_counters``):
        from the second step every gather is served, and after it (the first that prefetches) none allocates."""

    def borrow(self, nbytes: int) -> torch.UntypedStorage:
        """A storage of exactly ``nbytes`` bytes, idle or newly allocated (its content is undefined)."""
        idle = self._idle.get(nbytes)
        if idle:
            storage = idle.pop()
        else:
            storage = torch.empty(nbytes, dtype=torch.uint8, device=self.device).untyped_storage()
            self.allocations += 1
        self._lent += nbytes
        self.served += 1
        return storage

    def give_back(self, storage: torch.UntypedStorage) -> None:
        """Take a lent storage back: keep it idle within ``limit_bytes``, else free it."""
        nbytes = storage.nbytes()
        self._lent -= nbytes
        if self._lent + self.idle_bytes() + nbytes <= self.limit_bytes:
            self._idle.setdefault(nbytes, []).append(storage)

    def lent_bytes(self) -> int:
        return self._lent

    def idle_bytes(self) -> int:
        return sum(nbytes * len(storages) for nbytes, storages in self._idle.items())

    def clear(self) -> None:
        """Free every idle buffer (lent ones come back later and are kept within the limit)."""
        self._idle.clear()
