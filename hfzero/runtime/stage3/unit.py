"""One stage-3 gathering unit: its buckets, its reusable full buffer, and its shard lifecycle.

[Note: stage-3 release]
A unit's full buffer is one tensor made at construction whose storage has memory only while the unit is
gathered: a release takes the memory away and the next gather gives it back (See [Note: stage-3 gather
buffers] in buffers.py for how, on public torch API only). Autograd may have saved views of a parameter
(``weight.t()`` in a linear layer) during forward: those views share the storage, so a release frees
their memory too, and the backward gather refills the same storage before any of them is read. Between
uses the parameters point at a 0-element tensor of their dtype, so nothing can read stale or freed
memory through them.

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
from hfzero.runtime.stage3.buffers import GatherBuffers


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
                 device: torch.device, buffers: GatherBuffers | None = None, secondary: Communicator | None = None):
        """``buckets``/``frozen``: (bucket, this rank's shard slice of it) for the unit's trainable and
        frozen buckets; both are gathered into one full buffer (see [Note: stage-3 frozen parameters]).
        ``comm``: what gathers them, or one per layout partition (a bucket's ``partition`` indexes it: See
        [Note: bucket partitions] in layout.py).
        ``buffers``: what makes the full buffer (See [Note: stage-3 gather buffers]; None: the device's
        default backing). ``secondary``: the node's communicator for hpZ (See [Note: secondary partition])."""
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
        self.numel = sum(b.padded for b, _ in buckets + frozen)
        self.buffer = (buffers or GatherBuffers(dtype, device)).make(self.numel)
        """The full buffer's backing: memory only while gathered (See [Note: stage-3 gather buffers])."""
        self.full = self.buffer.tensor
        self._nbytes = self.buffer.nbytes
        self._empty = torch.empty(0, dtype=dtype, device=device)
        self._targets: list[tuple[torch.Tensor, torch.Tensor]] = []  # (full bucket view, shard slice)
        self._gathers: list[tuple[Communicator | QuantizedGather, torch.Tensor, torch.Tensor]] = []
        """(what gathers it, full bucket view, shard slice) per target: a gather's whole plan, made once."""
        self._views: list[tuple[nn.Parameter, torch.Tensor]] = []
        start = 0
        for bucket, shard in buckets + frozen:
            target = self.full[start: start + bucket.padded]
            self._targets.append((target, shard))
            self._gathers.append((self.comms[bucket.partition], target, shard))
            for slot in bucket.slots:
                view = self.full[start + slot.offset: start + slot.offset + slot.numel].view(slot.shape)
                self._views.append((slot.param, view))
            start += bucket.padded
        # what ``.data`` re-points per parameter: a DTensor's local tensor (See [Note: tensor-parallel
        # parameters]); the objects are final once the engine exists (meta parameters are swapped before)
        self._locals = [(local_tensor(param), view) for param, view in self._views]
        self._handles: list[Handle] = []
        self.buffer.release()
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
        """Give the full buffer memory and launch its all-gathers (asynchronously): from the shards over
        the group, or with a secondary partition held (hpZ) from it over the node; no-op unless SHARDED.
        ``exact``: unquantized even where ``comm`` is qwZ's quantized gather (state dicts)."""
        if self.state is not UnitState.SHARDED:
            return
        self.buffer.acquire()
        if self._secondary_parts is not None:  # See [Note: secondary partition]
            self._handles = [self.secondary.all_gather(full, part, async_op=True)
                             for (full, _), part in zip(self._targets, self._secondary_parts)]
        elif exact:
            self._handles = [(gather.comm if isinstance(gather, QuantizedGather) else gather).all_gather(
                                 full, shard, async_op=True) for gather, full, shard in self._gathers]
        else:
            self._handles = [gather.all_gather(full, shard, async_op=True) for gather, full, shard in self._gathers]
        self.state = UnitState.GATHERING

    def wait(self) -> None:
        """Finish the gather and point the parameters at views of the full buffer."""
        if self.state is not UnitState.GATHERING:
            return
        for handle in self._handles:
            handle.wait()
        self._handles = []
        for tensor, view in self._locals:
            tensor.data = view
        self.state = UnitState.GATHERED

    def release(self, keep_secondary: bool = False) -> None:
        """Drop the full buffer's memory (the shard stays); no-op when SHARDED. ``keep_secondary`` (a training
        forward's release, with hpZ): keep the node-local slice for the backward; otherwise any secondary is
        dropped."""
        if self.state is UnitState.SHARDED:
            return
        if self.state is UnitState.GATHERING:  # finish writing the buffer (hpZ may copy from it below)
            for handle in self._handles:
                handle.wait()
            self._handles = []
        if keep_secondary and self.secondary is not None:
            self._keep_secondary()
        else:
            self._secondary_parts = None
        self._point_at_empty()
        self.buffer.release()
        self.state = UnitState.SHARDED

    def _point_at_empty(self) -> None:
        empty = self._empty
        for tensor, _ in self._locals:
            tensor.data = empty
