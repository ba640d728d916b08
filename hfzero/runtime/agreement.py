"""Step agreement at stages 0-2: ranks that are at different training steps raise instead of mixing.

[Note: step agreement]
A rank that catches an exception in its forward and skips the batch (while the other ranks train on
theirs) would pair its next step's gradient reductions with the other ranks' current step: same
bucket sizes, so nothing fails, the gradients of two different steps are summed, and the run hangs
at its end, when that rank has one step fewer. To catch this, every rank counts its training forward
passes (forwards of the prepared model with gradients enabled) and, at the first backward of each
step, launches one asynchronous 2-element all-reduce (MAX of [count, -count]) on the data-parallel
group, ordered before that step's bucket reductions. The step waits for it where it already waits for
those reductions, and every rank whose count differs from another's raises StepMismatchError before
the optimizer applies anything. The counts go into a 2-element device tensor allocated once and filled
with ``fill_`` (no copy of Python data to the device), and the result is read once, at the step, together
with fp16's overflow flag (all-reduced after the step's reductions, copied next to the counts on the
device): the step's one host synchronization (See [Note: host-sync budget] in hfzero/testing/host_syncs.py). Stage 3
has a check of its own at the step, which packs its gather-order fingerprint and late-gradient flags
into one such read (stage3/step_check.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from hfzero.comm.collectives import Communicator, Handle
from hfzero.runtime.compile import eager_hook
from hfzero.runtime.lifetime import WeakHook


class StepMismatchError(RuntimeError):
    """Ranks reached the same collective at different training steps (see [Note: step agreement])."""


class StepAgreement:
    """Counts training forwards of ``model`` and checks, once per step, that every rank has the same count."""

    def __init__(self, model: nn.Module, comm: Communicator, *, replicate: Communicator | None = None):
        self.comm = comm
        self.replicate = replicate
        """HSDP: the replicate group; the check MAX-reduces the shard group's result over it too, before the
        one read, so the whole data-parallel world agrees (See [Note: hierarchical sharding] in engine.py)."""
        self.forwards = 0
        """Forward passes of the prepared model run with gradients enabled on this rank."""
        self._pending: tuple[Handle, int] | None = None
        self._values = torch.zeros(3, dtype=torch.int64, device=comm.device)
        """[count, -count, overflow flag], read once at the step; allocated once (scratch, 24 bytes)."""
        self._counts = self._values[:2]
        """[count, -count], all-reduced (MAX) in place."""
        # the counting hook's handle; see [Note: compiled regions] in compile.py and [Note: engine lifetime] in lifetime.py
        self.hook = model.register_forward_pre_hook(eager_hook(WeakHook(self._count)))

    def _count(self, module: nn.Module, args: object) -> None:
        if torch.is_grad_enabled():
            self.forwards += 1

    def launch(self) -> None:
        """At the first backward of a step: start the agreement all-reduce (asynchronous)."""
        if self.comm.world_size == 1 or self._pending is not None:
            return
        self._counts[0].fill_(self.forwards)  # a kernel with a scalar argument: no host synchronization
        self._counts[1].fill_(-self.forwards)
        self._pending = (self.comm.all_reduce(self._counts, op=dist.ReduceOp.MAX, async_op=True), self.forwards)

    def check(self, overflow: torch.Tensor | None = None) -> bool:
        """Before the step applies anything: raise on every rank whose step differs from another's. Returns
        whether ``overflow`` (fp16: the step's overflow flag, already all-reduced) is set, read with the
        counts in the step's one host synchronization."""
        if self._pending is None:  # no backward since the last step: the flag alone
            return bool(overflow.item() > 0) if overflow is not None else False
        handle, mine = self._pending
        self._pending = None
        handle.wait()
        if self.replicate is not None:
            if overflow is not None:
                self._values[2].copy_(overflow[0])
            else:
                self._values[2].zero_()
            self.replicate.all_reduce(self._values, op=dist.ReduceOp.MAX)
            overflow = self._values[2:3]
        if overflow is None:
            (most, negated_least), overflowed = self._counts.tolist(), 0  # the step's one host synchronization
        else:
            self._values[2].copy_(overflow[0])  # a device copy: no host synchronization
            most, negated_least, overflowed = self._values.tolist()  # the step's one host synchronization
        least = -negated_least
        if most != least:
            raise StepMismatchError(
                f"hfzero: ranks are at different training steps: this rank had run {mine} training forward "
                f"pass(es) when this step's backward began, others between {least} and {most}. A rank probably "
                "skipped a batch after an exception while the others trained on theirs, so their gradient "
                "reductions paired different steps. Skip a failed batch on every rank (catch the exception, "
                "agree, e.g. with an all_reduce of a flag, then call optimizer.zero_grad() everywhere).")
        return overflowed > 0

    def forget(self) -> None:
        """Drop an agreement of a step that was abandoned (zero_grad after a failure)."""
        if self._pending is not None:
            self._pending[0].wait()
            self._pending = None
