"""ZeRO-Offload: the shard's master weights, optimizer states and fp32 gradients in host memory.

Memory held in host memory per rank (Ψ trainable parameters, N ranks, a slice = Ψ/N, Ψ at stage 0),
pinned (page-locked) when the device is CUDA, so that copies run asynchronously on a copy stream:
- master weights of the slice (MASTER_SHARD, 4 bytes per element; allocated by the engine through
  ``HostOffload.empty``) and the inner optimizer's states (OPTIM_STATE, pinned after their creation
  by ``pin_states``);
- ``grad``: the slice's fp32 gradient. Stages 2-3 accumulate reduced gradients here across the
  backward passes of a step and keep none on the device (GRAD_SHARD, a model state, 4 bytes per
  element); stages 0-1 keep their full gradient on the device anyway and mirror the reduced sum of
  the slice here (GRAD_FP32, 4 bytes per element, what the host optimizer reads);
- ``staging``: where reduced slices land from the device and where updated 16-bit parameters are
  cast before going back (GRAD_BUCKET on the host, the parameter dtype's bytes per element).
Both buffers are allocated once: pinned allocation is slow and pinned memory is not returned cheaply.

[Note: offload copies]
Gradients, device -> host: when a bucket's reduction completes, the reducer calls ``push`` with the
rank's reduced slice. The copy stream first waits on the compute stream (on which the reduction's
wait was ordered), so the copy reads the reduced values; it copies into ``staging`` without blocking
the host and records an event. Backward goes on meanwhile. The device memory the copy reads must not
be written before the event: the reducer keeps a staging buffer it pooled back out of reuse until the
compute stream has waited on that event (``order_after``: the caching allocator cannot see reuse
within our own pool), ``record_stream`` keeps the caching allocator from handing the block to a new
tensor if the reducer drops it (pool trimming, the local accumulator) before the copy is done, and the
stages 0-1 gradient buffer is written again only after ``drain``. ``drain`` (end of a synchronizing
backward, the step's pending reduction, or a zero-bubble weight pass's ``reduce_added``) waits for
the events in push order and folds each slice into ``grad``, the host add of bucket k overlapping
the copy of bucket k+1: ADD at stages 2-3 (the device slice holds one backward's sum, the host holds
the step's), REPLACE at stages 0-1 (the device buffer holds the running sum, see [Note: gradient sums]). A bucket reduced twice in one backward
(stage-3 late gradients) drains first, so no staged slice is overwritten before it was folded.

Parameters, host -> device (``upload``): the copy stream waits on the compute stream (backward may
still read the parameters), a 16-bit slice is cast on the host into ``staging`` and copied without
blocking into the device parameters, and the compute stream waits on the copy's event before the
caller launches that bucket's all-gather: the copy of bucket k+1 overlaps the gather of bucket k; at
stage 3 every later gather is ordered after the copies into the shard. Before the host writes master
weights or ``staging`` again (the next step), ``wait_uploads`` waits for the copy stream.

On a CPU device there is no copy stream, pinning or event: copies are plain and synchronous, so the
same code path runs (and is tested) on CPU when forced with ``FORCE_ENV``.
"""

from __future__ import annotations

import os

import torch

from hfzero.logging import get_logger
from hfzero.runtime.layout import Bucket, FlatLayout

logger = get_logger(__name__)

FORCE_ENV = "HFZERO_FORCE_HOST_OFFLOAD"
"""Testing only: "1" runs the offload path even on a CPU device (host placement, plain copies)."""

_told_nothing_to_offload = False

def offload_active(offload_optimizer: bool, device: torch.device, rank: int) -> bool:
    """Whether the engine places its optimizer side in host memory: ``offload_optimizer`` on a device
    that is not the host. On a CPU device it says once (rank 0) that there is nothing to offload."""
    global _told_nothing_to_offload
    if not offload_optimizer:
        return False
    if device.type != "cpu" or os.environ.get(FORCE_ENV) == "1":
        return True
    if rank == 0 and not _told_nothing_to_offload:
        logger.warning("offload_optimizer=True on a CPU device: nothing to offload (master weights and optimizer "
                       "states already live in host memory); running the ordinary path")
        _told_nothing_to_offload = True
    return False


class HostOffload:
    """The host side of an offloaded shard; see the module docstring and [Note: offload copies]."""

    def __init__(self, layout: FlatLayout, device: torch.device, param_dtype: torch.dtype, accumulate: bool):
        """``accumulate``: True at stages 2-3 (host ADDs each reduction), False at stages 0-1 (REPLACE)."""
        self.layout = layout
        self.device = device
        self.pinned = device.type == "cuda"
        self.accumulate = accumulate
        self.copy_stream = torch.cuda.Stream(device=device) if self.pinned else None
        self.grad = self.empty(layout.shard_numel, torch.float32)
        self.staging = self.empty(layout.shard_numel, param_dtype)
        self._copies: dict[int, torch.cuda.Event | None] = {}  # bucket index -> copy done, not yet folded
        self._holds: set[int] = set()  # buckets whose ``grad`` slice holds gradients of this step
        self.pushed = 0
        """Slices copied to the host since construction (tests check the path ran)."""

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """An uninitialized host tensor, pinned when the device is CUDA."""
        return torch.empty(numel, dtype=dtype, device="cpu", pin_memory=self.pinned)

    def _slice(self, flat: torch.Tensor, bucket: Bucket) -> torch.Tensor:
        return flat[bucket.shard_offset: bucket.shard_offset + bucket.chunk]

    # ---- gradients, device -> host --------------------------------------------------------------
    def push(self, bucket: Bucket, reduced: torch.Tensor) -> torch.cuda.Event | None:
        """Start copying ``reduced`` (this rank's reduced slice of ``bucket``) into host staging.

        Returns the event after which the device memory of ``reduced`` may be written (None on CPU).
        """
        if bucket.index in self._copies:
            self.drain()
        target = self._slice(self.staging, bucket)
        self.pushed += 1
        if self.copy_stream is None:
            target.copy_(reduced)
            self._copies[bucket.index] = None
            return None
        self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        done = torch.cuda.Event()
        with torch.cuda.stream(self.copy_stream):
            target.copy_(reduced, non_blocking=True)
            done.record(self.copy_stream)
        reduced.record_stream(self.copy_stream)  # a buffer the reducer drops is not reallocated under the copy
        self._copies[bucket.index] = done
        return done

    def order_after(self, done: torch.cuda.Event | None) -> None:
        """Make later compute-stream work wait for ``done`` (a device-side wait; the host goes on)."""
        if done is not None:
            torch.cuda.current_stream(self.device).wait_event(done)

    def drain(self) -> None:
        """Wait for the pushed copies, in order, and fold each into ``grad`` (ADD or REPLACE)."""
        for index, done in self._copies.items():
            if done is not None:
                done.synchronize()
            bucket = self.layout.buckets[index]
            grad, staged = self._slice(self.grad, bucket), self._slice(self.staging, bucket)
            if self.accumulate and index in self._holds:
                grad.add_(staged)
            else:
                grad.copy_(staged)
            self._holds.add(index)
        self._copies.clear()

    def gradient(self, bucket: Bucket) -> torch.Tensor:
        """The host fp32 gradient sum of this rank's slice of ``bucket`` (zeros if nothing arrived)."""
        grad = self._slice(self.grad, bucket)
        if bucket.index not in self._holds:
            grad.zero_()
            self._holds.add(bucket.index)
        return grad

    def reset(self) -> None:
        """Forget this step's gradients (after the step, zero_grad or an aborted pass)."""
        for done in self._copies.values():
            if done is not None:
                done.synchronize()
        self._copies.clear()
        self._holds.clear()

    # ---- parameters, host -> device -------------------------------------------------------------
    def begin_upload(self) -> None:
        """Order the coming parameter copies after the compute stream's work (which may read them)."""
        if self.copy_stream is not None:
            self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))

    def upload(self, bucket: Bucket, master: torch.Tensor, target: torch.Tensor) -> None:
        """Copy ``master`` (host fp32) into the device parameters ``target``; the compute stream waits
        for it, so a collective launched next on ``target`` reads the new values."""
        source = master if master.dtype == target.dtype else self._slice(self.staging, bucket).copy_(master)
        if self.copy_stream is None:
            target.copy_(source)
            return
        done = torch.cuda.Event()
        with torch.cuda.stream(self.copy_stream):
            target.copy_(source, non_blocking=True)
            done.record(self.copy_stream)
        self.order_after(done)

    def wait_uploads(self) -> None:
        """Block until every copy issued so far is done: the host may write masters and staging again."""
        if self.copy_stream is not None:
            self.copy_stream.synchronize()

    def pin_states(self, optimizer: torch.optim.Optimizer) -> None:
        """Move the optimizer's state tensors into pinned memory (CUDA devices). Called after every step: states
        the step created are pinned then, states already pinned are left as they are."""
        if not self.pinned:
            return
        for state in optimizer.state.values():
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and value.device.type == "cpu" and not value.is_pinned():
                    state[key] = value.pin_memory()

    # ---- accounting -----------------------------------------------------------------------------
    def grad_bytes(self) -> int:
        return self.grad.numel() * self.grad.element_size()

    def staging_bytes(self) -> int:
        return self.staging.numel() * self.staging.element_size()
