"""One stage-3 gathering unit: its buckets, its reusable full buffer, and its shard lifecycle.

[Note: stage-3 release]
A unit's full buffer is one tensor allocated at construction whose *storage* is resized to zero
bytes when the unit is released and back to full size before each gather (as FSDP1 does). Autograd
may have saved views of a parameter (``weight.t()`` in a linear layer) during forward: those views
share the storage, so resizing it frees their memory too, and the backward gather refills the same
storage before any of them is read. Between uses the parameters point at a 0-element tensor of
their dtype, so nothing can read stale or freed memory through them. With a buffer pool the
storage's memory is borrowed for each gather instead of allocated; see [Note: stage-3 gather
buffers] in buffers.py, which keeps this guarantee.

[Note: secondary partition]
hpZ (ZeRO++, ``ZeroConfig.secondary_partition``): a unit released in a training forward first copies the
node-local slice of its gathered buffer, ``full.view(ranks_per_node, -1)[node_rank]`` per bucket (buckets are
padded to a multiple of the group size, which the ranks per node divide), into ``_secondary_parts``
(PARAM_SECONDARY). The next gather of that unit (its backward, or an activation-checkpoint recomputation)
all-gathers those slices over the node's communicator (every rank of the node holds a different slice of the
same values) instead of the shards over the whole group, so it never leaves the node. A release outside the
forward window (the backward being done with the unit) drops the slices, and the scheduler drops them all
whenever the parameters change (``release_all``: the step, a load, a failed pass). Which gathers use the node
is the same on every rank (the scheduler's window is), so collective order stays rank-independent.
"""

from __future__ import annotations

import enum

import torch
from torch import nn

from hfzero.comm.collectives import Communicator, Handle
from hfzero.comm.quantized import QuantizedGather
from hfzero.runtime.layout import Bucket
from hfzero.runtime.tensors import local_tensor
from hfzero.runtime.stage3.buffers import GatherBufferPool


class UnitState(enum.Enum):
    """What memory a gathering unit holds.

    SHARDED: only this rank's slices (PARAM_SHARD, owned by the engine) are resident; the unit's
        parameters are 0-element tensors and its full buffer has no storage.
    GATHERING: an all-gather into the full buffer is in flight; the full buffer is allocated
        (PARAM_GATHERED) but the parameters still point at empty tensors.
    GATHERED: the full buffer is resident (PARAM_GATHERED) and the parameters are views of it.
    """

    SHARDED = "sharded"
    GATHERING = "gathering"
    GATHERED = "gathered"


class GatherUnit:
    """The gathered (non-persistent) buckets of one unit; see [Note: stage-3 release]."""

    def __init__(self, index: int, name: str, module: nn.Module, buckets: list[tuple[Bucket, torch.Tensor]],
                 frozen: list[tuple[Bucket, torch.Tensor]],
                 comm: Communicator | QuantizedGather | list[Communicator | QuantizedGather], dtype: torch.dtype,
                 device: torch.device, pool: GatherBufferPool | None = None, secondary: Communicator | None = None):
        """``buckets``/``frozen``: (bucket, this rank's shard slice of it) for the unit's trainable and
        frozen buckets; both are gathered into one full buffer (see [Note: stage-3 frozen parameters]).
        ``comm``: what gathers them, or one per layout partition (a bucket's ``partition`` indexes it: See
        [Note: bucket partitions] in layout.py).
        ``pool``: where the full buffer's memory is borrowed from per gather (see [Note: stage-3 gather
        buffers]); None keeps today's storage resize. ``secondary``: the node's communicator for hpZ (See
        [Note: secondary partition])."""
        self.secondary = secondary
        self._secondary_parts: list[torch.Tensor] | None = None
        """hpZ: this rank's node-local slice of each target, kept from a training forward to its backward."""
        self.index = index
        self.name = name
        self.module = module
        self.buckets = [b for b, _ in buckets]
        """The trainable buckets: their reductions launch when the backward pass is done with the unit."""
        self.has_frozen = bool(frozen)
        self.comms = comm if isinstance(comm, list) else [comm]
        """What gathers each partition's buckets (``Bucket.partition`` indexes it)."""
        self.comm = self.comms[0]
        """What gathers partition 0's buckets: the data-parallel group's (the only one without expert parallelism)."""
        self.state = UnitState.SHARDED
        self.pool = pool
        self._borrowed: torch.UntypedStorage | None = None  # the pool buffer whose memory the unit holds
        self.numel = sum(b.padded for b, _ in buckets + frozen)
        self.full = torch.empty(self.numel, dtype=dtype, device=device)
        self._nbytes = self.numel * self.full.element_size()
        self._empty = torch.empty(0, dtype=dtype, device=device)
        self._targets: list[tuple[torch.Tensor, torch.Tensor]] = []  # (full bucket view, shard slice)
        self._partitions = [b.partition for b, _ in buckets + frozen]  # each target's gathering group
        self._views: list[tuple[nn.Parameter, torch.Tensor]] = []
        start = 0
        for bucket, shard in buckets + frozen:
            self._targets.append((self.full[start: start + bucket.padded], shard))
            for slot in bucket.slots:
                view = self.full[start + slot.offset: start + slot.offset + slot.numel].view(slot.shape)
                self._views.append((slot.param, view))
            start += bucket.padded
        self._handles: list[Handle] = []
        self._free_storage()
        self._point_at_empty()

    @property
    def params(self) -> list[nn.Parameter]:
        return [p for p, _ in self._views]

    def resident_bytes(self) -> int:
        """Bytes of the full buffer while allocated (PARAM_GATHERED), else 0."""
        return 0 if self.state is UnitState.SHARDED else self._nbytes

    def secondary_bytes(self) -> int:
        """Bytes of the hpZ secondary partition held now (PARAM_SECONDARY), else 0."""
        return 0 if self._secondary_parts is None else sum(p.numel() for p in self._secondary_parts) * self.full.element_size()

    def drop_secondary(self) -> None:
        """Forget the secondary partition (the parameters changed, or the backward is done with the unit)."""
        self._secondary_parts = None

    def _keep_secondary(self) -> None:
        """Copy this rank's node-local slice of the gathered unit (See [Note: secondary partition])."""
        size, rank = self.secondary.world_size, self.secondary.rank
        self._secondary_parts = [full.view(size, -1)[rank].clone() for full, _ in self._targets]

    def start_gather(self, exact: bool = False) -> None:
        """Give the full buffer memory (a pool buffer, else a fresh allocation) and launch its
        all-gathers (asynchronously): from the shards over the group, or with a secondary partition held
        (hpZ) from it over the node; no-op unless SHARDED. ``exact``: unquantized even where ``comm`` is qwZ's
        quantized gather (state dicts)."""
        if self.state is not UnitState.SHARDED:
            return
        if self.pool is None:
            self.full.untyped_storage().resize_(self._nbytes)
        else:  # See [Note: stage-3 gather buffers]
            self._borrowed = self.pool.borrow(self._nbytes)
            self.full.untyped_storage()._swap_data_ptr_(self._borrowed)
        if self._secondary_parts is not None:  # See [Note: secondary partition]
            self._handles = [self.secondary.all_gather(full, part, async_op=True)
                             for (full, _), part in zip(self._targets, self._secondary_parts)]
        else:
            gathers = [c.comm if exact and isinstance(c, QuantizedGather) else c for c in self.comms]
            self._handles = [gathers[partition].all_gather(full, shard, async_op=True)
                             for (full, shard), partition in zip(self._targets, self._partitions)]
        self.state = UnitState.GATHERING

    def wait(self) -> None:
        """Finish the gather and point the parameters at views of the full buffer."""
        if self.state is not UnitState.GATHERING:
            return
        for handle in self._handles:
            handle.wait()
        self._handles = []
        for param, view in self._views:  # a DTensor's local shard (See [Note: tensor-parallel parameters])
            local_tensor(param).data = view
        self.state = UnitState.GATHERED

    def release(self, keep_secondary: bool = False) -> None:
        """Drop the full buffer (the shard stays); no-op when SHARDED. ``keep_secondary`` (a training forward's
        release, with hpZ): keep the node-local slice for the backward; otherwise any secondary is dropped."""
        if self.state is UnitState.SHARDED:
            return
        self.wait()
        if keep_secondary and self.secondary is not None:
            self._keep_secondary()
        else:
            self._secondary_parts = None
        self._point_at_empty()
        self._free_storage()
        self.state = UnitState.SHARDED

    def _point_at_empty(self) -> None:
        for param, _ in self._views:
            local_tensor(param).data = self._empty

    def _free_storage(self) -> None:
        """The full buffer's storage to 0 bytes: its memory goes back to the pool (or is freed)."""
        if self._borrowed is None:
            self.full.untyped_storage().resize_(0)
            return
        borrowed, self._borrowed = self._borrowed, None
        self.full.untyped_storage()._swap_data_ptr_(borrowed)  # the unit's storage is empty again
        self.pool.give_back(borrowed)
