"""Fragmentation ratios from allocator counters: pure functions on recorded numbers, no torch.

The probe (profiler/allocator.py) records them at every sample and the reader (profiler/reader.py) fills the
CUDA one into profiles written before it was recorded, so both compute it here, one way. Holds no memory.

- CPU: ``heap_fragmentation`` = ``fordblks / arena``, the malloc heap's free-but-held fraction.
- CUDA: ``split_fragmentation`` = ``inactive_split_bytes / reserved_bytes``: the caching allocator's free blocks
  that sit inside segments still partly in use (split blocks: torch's "inactive, non-releasable" memory),
  as a fraction of what it reserved. A segment that is wholly free is cache, not fragmentation (it can be
  released and reused whole), so it is left out; what is counted is memory the allocator holds but can only
  hand out in pieces no larger than those blocks. ``torch.cuda.memory_stats()`` has these counters at no
  cost, so every sample carries the figure. The allocator snapshot's ``1 - largest free block / total free``
  (profiler/allocator.py ``cuda_snapshot_summary``, only with ``cuda_snapshot=True``) says instead how
  scattered the free memory is; it is recorded beside this one, under its own key.
"""

from __future__ import annotations


def heap_fragmentation(arena: int, fordblks: int) -> float | None:
    """Free-but-held fraction of the malloc heap: ``fordblks / arena``; None for an empty heap."""
    return fordblks / arena if arena > 0 else None


def split_fragmentation(inactive_split: int | float | None, reserved: int | float | None) -> float | None:
    """Fraction of the CUDA caching allocator's reserved bytes that are free blocks inside segments in use:
    ``inactive_split / reserved``; 0.0 with nothing reserved, None when a counter is missing."""
    if inactive_split is None or reserved is None:
        return None
    return inactive_split / reserved if reserved > 0 else 0.0
