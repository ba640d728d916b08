"""Which element ranges of which parameters a rank holds or writes. See [Note: bucket sharding].

A rank's master view of a bucket covers a contiguous range of the bucket: its owned slice
(``Bucket.owned(rank)``) when the layout shards (stages 1-3), the whole padded bucket at stage 0. A bucket
of a layout partition other than the first (expert parallelism's experts: [Note: bucket partitions] in
runtime/layout.py) is owned and split by the rank's index in that partition's group.
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


def _place(layout: FlatLayout, bucket: Bucket, rank: int, world_size: int) -> tuple[int, int]:
    """(rank, group size) for ``bucket``: ``rank`` of ``world_size`` (partition 0's group, the caller's) or,
    for a bucket of another partition, this rank's index in that partition's group and its size."""
    if bucket.partition == 0:
        return rank, world_size
    part = layout.partitions[bucket.partition]
    return part.rank, part.ranks


def held_range(layout: FlatLayout, bucket: Bucket, rank: int) -> tuple[int, int]:
    """The range of ``bucket`` (bucket-relative elements) that ``rank``'s master view covers."""
    if bucket.shard_world == 1:
        return 0, bucket.padded
    return bucket.owned(_place(layout, bucket, rank, layout.shard_world)[0])


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

    Sharded buckets write what they own. At stage 0 every rank holds every bucket whole, so the
    writing is split: rank r writes the r-th of ``world_size`` equal parts of each bucket (of a bucket of
    another partition: the part of its index in that partition's group), and the ranks together write
    each element exactly once.
    """
    out = []
    for bucket in layout.buckets:
        if bucket.shard_world > 1:
            lo, hi = held_range(layout, bucket, rank)
            out += _meet(bucket, lo, hi, lo)
            continue
        index, size = _place(layout, bucket, rank, world_size)
        part = math.ceil(bucket.padded / size)
        lo, hi = index * part, min((index + 1) * part, bucket.padded)
        out += _meet(bucket, lo, hi, 0)
    return out
