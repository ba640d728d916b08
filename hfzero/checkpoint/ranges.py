"""Which element ranges of which parameters a rank holds or writes. See [Note: bucket sharding].

A rank's master view of a bucket covers a contiguous range of the bucket: its owned slice
(``Bucket.owned(rank)``) when the layout shards (stages 1-3), the whole padded bucket at stage 0.
Since a parameter never spans buckets, the view meets each parameter in at most one contiguous
element range of the flattened parameter; padding elements belong to no parameter and are not
saved. Checkpoints are keyed by these per-parameter ranges, never by bucket, so any layout
(another world size, stage or bucket size) can read any other's.

Computed from the layout's public attributes only; holds no tensor memory.
"""

from __future__ import annotations

import dataclasses
import math

from hfzero.runtime.layout import Bucket, FlatLayout


@dataclasses.dataclass(frozen=True)
class ParamRange:
    """Elements ``[start, end)`` of flattened parameter ``name`` sit at ``[view_start, view_start + end - start)``
    of this rank's master view of bucket ``bucket``."""

    name: str
    start: int
    end: int
    bucket: int
    view_start: int

    @property
    def numel(self) -> int:
        return self.end - self.start


def held_range(layout: FlatLayout, bucket: Bucket, rank: int) -> tuple[int, int]:
    """The range of ``bucket`` (bucket-relative elements) that ``rank``'s master view covers."""
    return bucket.owned(rank) if layout.shard_world > 1 else (0, bucket.padded)


def _meet(bucket: Bucket, lo: int, hi: int, view_origin: int) -> list[ParamRange]:
    """Parameter ranges inside bucket range ``[lo, hi)``; ``view_origin`` is the bucket element at view index 0."""
    out = []
    for slot in bucket.slots:
        a = max(lo, slot.offset)
        b = min(hi, slot.offset + slot.numel)
        if a < b:
            out.append(ParamRange(slot.name, a - slot.offset, b - slot.offset, bucket.index, a - view_origin))
    return out


def held_ranges(layout: FlatLayout, rank: int) -> list[ParamRange]:
    """Every parameter range in ``rank``'s master views (what a load must fill)."""
    out = []
    for bucket in layout.buckets:
        lo, hi = held_range(layout, bucket, rank)
        out += _meet(bucket, lo, hi, lo)
    return out


def written_ranges(layout: FlatLayout, rank: int, world_size: int) -> list[ParamRange]:
    """The parameter ranges ``rank`` writes to its checkpoint file.

    Sharded layouts write what they own. At stage 0 every rank holds every bucket whole, so the
    writing is split: rank r writes the r-th of ``world_size`` equal parts of each bucket, and the
    ranks together write each element exactly once.
    """
    if layout.shard_world > 1:
        return held_ranges(layout, rank)
    out = []
    for bucket in layout.buckets:
        part = math.ceil(bucket.padded / world_size)
        lo, hi = rank * part, min((rank + 1) * part, bucket.padded)
        out += _meet(bucket, lo, hi, 0)
    return out
