"""Flat layout of the trainable parameters: buckets, padding and each rank's slice.

This module alone decides partition ranges. See [Note: bucket sharding].

[Note: bucket sharding]
Trainable parameters of each optimizer param group are laid out in reverse registration order
(close to the order backward produces their gradients) and cut into buckets of about
``reduce_bucket_size`` elements; a parameter is never split across buckets. Buckets are sorted by
the backward position at which they become complete, which is also the fixed order in which every
rank launches their reductions (identical order on all ranks, so an unused parameter on one rank
delays but never mismatches a collective). Inside a bucket every parameter starts at a multiple of
``ALIGN`` elements (see [Note: slot alignment]); each bucket is padded to a multiple of
``shard_world * ALIGN`` elements and every rank owns the equal slice
``[rank * chunk, (rank + 1) * chunk)`` of it, so a bucket's gradient reduction is one
reduce-scatter and its parameter update one all-gather, both of constant size. Stage 0 uses
``shard_world = 1``: every rank owns every bucket whole. A rank's shard is the concatenation of its
slices of all buckets (``Bucket.shard_offset``); fp32 master weights, optimizer states and the stage-2
gradient shard are laid out that way.

[Note: bucket partitions]
A layout may shard different parameters over different groups of ranks: ``partitions`` lists them and
``partition_of`` maps a parameter to its index (default: one partition, ``shard_world`` ranks, this rank
``rank``). Under expert parallelism (parallel/expert.py) partition 0 is the whole data-parallel
world (the dense parameters, the same on every rank) and partition 1 the expert-data-parallel group (the
experts, DTensor shards whose local tensors differ between EP ranks). A bucket never holds parameters of
two partitions (a change of partition cuts a bucket, as a change of stage-3 unit does); its ``chunk`` and
owned range follow its own partition's size and rank (``Bucket.shard_world``, ``Bucket.rank``,
``Bucket.mine()``), and its collectives run on its partition's communicator (the engine keeps one per
partition). The bucket order is still the backward order, computed from shapes and positions only, so
it is the same on every rank, and the reductions and gathers of the two partitions interleave in the same
order everywhere.

[Note: slot alignment]
Every buffer laid out by this module starts at a 16-byte multiple (torch's allocations are 64-byte
aligned on the host, 512-byte on CUDA; sub-buffers start at bucket or chunk boundaries, which are
multiples of ``ALIGN`` elements). Inside a bucket, each parameter's slot starts at a multiple of
``ALIGN = 8`` elements: 16 bytes in the 16-bit dtypes (the smallest element in any flat buffer:
bf16/fp16 parameters, gradients and compute copies) and 32 bytes in fp32 (masters, optimizer states,
fp32 gradients), so every parameter, gradient and master view is 16-byte aligned in every dtype in
use. 16 bytes is the width of CUDA's vectorized loads (float4, 8 x bf16), the alignment PyTorch's
vectorized and multi-tensor kernels test before falling back to scalar code; a stronger one (64, 256
bytes) would cost up to 31 or 127 padding elements per parameter for no kernel we call. Padding sits
after a parameter's last element, belongs to no parameter, is zero in every buffer (parameters,
gradients, masters, optimizer states: zero gradients keep element-wise optimizer updates and
weight decay at zero) and is never saved (checkpoints are keyed by per-parameter ranges,
checkpoint/ranges.py). Bucket membership counts parameter elements only, so it does not depend on
the alignment. Layouts written before slots were aligned (``slot_align=1``; optimizer state format 1)
are rebuilt with ``FlatLayout.realigned(1)`` to read them (runtime/legacy_state.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable

import torch
from torch import nn

from hfzero.runtime.tensors import local_tensor

ALIGN = 8
"""Slot offsets and chunk sizes are multiples of this many elements: 16 bytes in 16-bit dtypes, 32 in
fp32. See [Note: slot alignment]."""


def align_up(numel: int, align: int = ALIGN) -> int:
    """``numel`` rounded up to a multiple of ``align``."""
    return -(-numel // align) * align


@dataclasses.dataclass(eq=False)
class ParamSlot:
    """Where one parameter lives: its bucket and element offset inside the bucket."""

    param: nn.Parameter
    name: str
    bucket: int
    offset: int
    numel: int
    shape: torch.Size
    stride: tuple[int, ...] = dataclasses.field(init=False, repr=False)
    """The contiguous strides of ``shape``: the gradient hook views its flat slot shaped like the parameter in one
    op (``as_strided``)."""

    def __post_init__(self) -> None:
        stride, step = [], 1
        for size in reversed(self.shape):
            stride.append(step)
            step *= max(size, 1)
        self.stride = tuple(reversed(stride))


@dataclasses.dataclass(frozen=True)
class Partition:
    """The group of ranks a bucket is sharded over (See [Note: bucket partitions]).

    Attributes:
        ranks: ranks in the group (its communicator's size).
        rank: this rank's index in the group.
        sharded: whether the group shards its buckets (stages 1-3: each rank owns 1 / ranks of a bucket);
            False at stage 0, where every rank of the group holds every bucket whole (and all-reduces it).
    """

    ranks: int
    rank: int
    sharded: bool = True

    @property
    def shard_world(self) -> int:
        """Ranks a bucket is split among: ``ranks`` when sharded, else 1."""
        return self.ranks if self.sharded else 1

    @property
    def shard_rank(self) -> int:
        """This rank's slice index in a bucket: ``rank`` when sharded, else 0 (it holds the bucket whole)."""
        return self.rank if self.sharded else 0


@dataclasses.dataclass(eq=False)
class Bucket:
    """A contiguous range of the flat buffer reduced and gathered as one unit."""

    index: int
    group: int
    slots: list[ParamSlot]
    offset: int
    """Start of the bucket in the flat parameter buffer."""
    numel: int
    """Elements of real parameters (no padding)."""
    padded: int
    """Elements including padding (between parameters and at the end): a multiple of shard_world * ALIGN."""
    chunk: int
    """Elements each rank owns: padded // shard_world."""
    shard_offset: int
    """Start of this rank's slice of the bucket inside the rank's shard."""
    partition: int = 0
    """Index of the partition (group of ranks) the bucket is sharded over; See [Note: bucket partitions]."""
    shard_world: int = 1
    """Ranks the bucket is split among (its partition's; 1 where it is not sharded)."""
    rank: int = 0
    """This rank's slice index in the bucket (0 where it is not sharded)."""

    def owned(self, rank: int) -> tuple[int, int]:
        """The slice of ``rank`` (an index in the bucket's partition), as a range inside the bucket."""
        return rank * self.chunk, (rank + 1) * self.chunk

    def mine(self) -> tuple[int, int]:
        """This rank's slice, as a range inside the bucket: the whole padded bucket where it is not sharded."""
        return self.owned(self.rank)


class FlatLayout:
    """Buckets of the trainable parameters and this rank's slice of each.

    Holds no tensor memory: it maps parameters to ranges that the engine's buffers use.
    """

    def __init__(self, groups: list[list[tuple[int, str, nn.Parameter]]], bucket_size: int, shard_world: int,
                 rank: int, unit_of: Callable[[nn.Parameter], Hashable] | None = None, slot_align: int = ALIGN,
                 partitions: list[Partition] | None = None, partition_of: Callable[[nn.Parameter], int] | None = None):
        """``groups[g]`` lists (backward position, name, parameter) of group g, sorted by position.

        ``unit_of`` (stage 3) maps a parameter to its gathering unit: a bucket never holds parameters
        of two units, so a unit's parameters are whole buckets. ``slot_align``: each parameter starts
        at a multiple of this many elements inside its bucket; ``ALIGN`` unless rebuilding the layout
        of a state saved before slots were aligned (1). See [Note: slot alignment].
        ``partitions``/``partition_of``: the groups buckets are sharded over and each parameter's index in
        ``partitions`` (default: one, ``shard_world`` ranks of which this is ``rank``); ``shard_world`` and
        ``rank`` are partition 0's. See [Note: bucket partitions].
        """
        self.shard_world = shard_world
        self.rank = rank
        self.partitions = partitions or [Partition(shard_world, rank if shard_world > 1 else 0, shard_world > 1)]
        part_of = partition_of or (lambda p: 0)
        self._inputs = (groups, bucket_size, unit_of, partitions, partition_of)
        drafts: list[tuple[int, int, list[tuple[str, nn.Parameter]]]] = []  # (ready position, group, params)
        for group_index, named in enumerate(groups):
            current: list[tuple[str, nn.Parameter]] = []
            size = 0
            previous = 0
            for position, name, param in named:
                if current and ((unit_of is not None and unit_of(param) != unit_of(current[-1][1]))
                                or part_of(param) != part_of(current[-1][1])):
                    drafts.append((previous, group_index, current))
                    current, size = [], 0
                previous = position
                current.append((name, param))
                size += local_tensor(param).numel()
                if size >= bucket_size:
                    drafts.append((position, group_index, current))
                    current, size = [], 0
            if current:
                drafts.append((named[-1][0], group_index, current))
        drafts.sort(key=lambda d: (d[0], d[1]))
        self.buckets: list[Bucket] = []
        self.slots: dict[nn.Parameter, ParamSlot] = {}
        offset = shard_offset = 0
        for index, (_, group_index, params) in enumerate(drafts):
            partition = part_of(params[0][1])
            part = self.partitions[partition]
            bucket = Bucket(index, group_index, [], offset, numel=0, padded=0, chunk=0, shard_offset=shard_offset,
                            partition=partition, shard_world=part.shard_world, rank=part.shard_rank)
            inner = 0
            for name, param in params:
                local = local_tensor(param)  # See [Note: tensor-parallel parameters] in parallel/tensor.py
                inner = align_up(inner, slot_align)  # See [Note: slot alignment]
                slot = ParamSlot(param, name, index, inner, local.numel(), local.shape)
                bucket.slots.append(slot)
                self.slots[param] = slot
                inner += local.numel()
                bucket.numel += local.numel()
            bucket.padded = align_up(inner, bucket.shard_world * ALIGN)
            bucket.chunk = bucket.padded // bucket.shard_world
            self.buckets.append(bucket)
            offset += bucket.padded
            shard_offset += bucket.chunk
        self.total_padded = offset
        self.shard_numel = shard_offset
        self.num_params = sum(b.numel for b in self.buckets)
        """Elements of the trainable parameters; ``total_padded - num_params`` elements are padding."""

    def realigned(self, slot_align: int) -> FlatLayout:
        """The layout of the same parameters, bucket size and ranks with another slot alignment (the
        same buckets holding the same parameters: membership ignores alignment)."""
        groups, bucket_size, unit_of, partitions, partition_of = self._inputs
        return FlatLayout(groups, bucket_size, self.shard_world, self.rank, unit_of, slot_align, partitions,
                          partition_of)

    def group_buckets(self, group: int) -> list[Bucket]:
        return [b for b in self.buckets if b.group == group]
