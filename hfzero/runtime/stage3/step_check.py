"""Stage 3's one check per optimizer step: gather order and late gradients, one collective, one read.

[Note: stage-3 step check]
Stage 3 used to synchronize the host five times per micro-batch: an all-gather of a signature at the
end of every forward and every backward pass (the gather-order check), each from a tensor built from
Python data, and a ``.tolist()`` of the late-gradient flags at the end of every backward. Each one
drained the device's queue. Now the training passes (a forward with gradients enabled, every backward)
fold their signatures into a running fingerprint kept on the host (plain Python: no device work), late
gradients stay in their buffers, and at the optimizer step (``materialize_grads``, where the step waits
for its reductions anyway) one all-reduce (MAX) of an int64 tensor allocated once,
``[fingerprint, -fingerprint, overflow, late flag of bucket 0, ..., late flag of bucket B-1]``, filled
with ``fill_`` (fp16's overflow flag of the reduced sums copied in on the device), is read once. Ranks
agree on the fingerprint when ``max == -max(-fingerprint)``; the flags say which buckets any rank has late
gradients for, so every rank launches the same second reductions.
What moved: a rank that gathered other units than another's in a training pass now raises
GatherOrderError at the next ``optimizer.step()`` (or ``clip_grad_norm_``), before anything is applied,
instead of at the end of that pass; the error names the first pass where ranks differ. Forwards without
gradients (evaluation, ``generate``) are checked at their end as before, since no step follows them.
Late gradients (rare: a parameter used outside its unit's backward) are summed locally over the step's
micro-batches and reduced once, at the step; with fp16, a step that has any reads the overflow flag once
more after reducing them (the packed flag saw the sums before them), its only second synchronization.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist

from hfzero.comm.collectives import Communicator


class StepCheck:
    """The packed all-reduce of [Note: stage-3 step check]. Memory: one int64 tensor of 3 + B elements."""

    def __init__(self, comm: Communicator, num_buckets: int, *, replicate: Communicator | None = None):
        self.comm = comm
        self.replicate = replicate
        """HSDP: the replicate group, over which the shard group's MAX is reduced once more before the read (the
        whole data-parallel world agrees; See [Note: hierarchical sharding] in runtime/engine.py)."""
        self._values = torch.zeros(3 + num_buckets, dtype=torch.int64, device=comm.device)

    def run(self, fingerprint: int, late: Iterable[int],
            overflow: torch.Tensor | None = None) -> tuple[bool, list[int], bool]:
        """Collective over ``comm``'s group, once per step: (whether every rank has ``fingerprint``, the
        buckets for which any rank has late gradients, whether any rank's ``overflow`` flag is set).
        ``fingerprint`` is in [0, 2^62); ``overflow``: fp16's 1-element flag of this rank (not reduced)."""
        values = self._values
        values.zero_()
        values[0].fill_(fingerprint)  # kernels with scalar arguments: no host synchronization
        values[1].fill_(-fingerprint)
        if overflow is not None:
            values[2].copy_(overflow[0])  # a device copy: no host synchronization
        for index in late:
            values[3 + index].fill_(1)
        if self.comm.world_size > 1:
            self.comm.all_reduce(values, op=dist.ReduceOp.MAX)
        if self.replicate is not None:
            self.replicate.all_reduce(values, op=dist.ReduceOp.MAX)
        read = values.tolist()  # the step's one host synchronization
        return read[0] == -read[1], [i for i, flag in enumerate(read[3:]) if flag], read[2] > 0
