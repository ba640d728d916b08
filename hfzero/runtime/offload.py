"""ZeRO-Offload: the shard's master weights, optimizer states and fp32 gradients in host memory.

Memory held in host memory per rank (Ψ trainable parameters, N ranks, a slice = Ψ/N, Ψ at stage 0):
- master weights of the slice (MASTER_SHARD, 4 bytes per element; allocated by the engine through
  ``HostOffload.empty_master``) and the inner optimizer's states (OPTIM_STATE);
- ``grad``: the slice's fp32 gradient. Stages 2-3 accumulate reduced gradients here across the
  backward passes of a step and keep none on the device (GRAD_SHARD, a model state, 4 bytes per
  element); stages 0-1 keep their full gradient on the device anyway and mirror the reduced sum of
  the slice here (GRAD_FP32, 4 bytes per element, what the host optimizer reads);
- ``staging``: where reduced slices land from the device and where updated 16-bit parameters are
  cast before going back (GRAD_BUCKET on the host, the parameter dtype's bytes per element).
Both buffers are allocated once: pinned allocation is slow and pinned memory is not returned cheaply.

Pinned (page-locked) on CUDA are only the buffers a DMA copy touches: ``staging`` (both directions) and
the master weights when they are the upload's source (fp32 parameters: no host cast, the master copies
straight to the device). Optimizer states and ``grad`` are read and written by the host alone, so they
stay pageable: page-locked memory cannot be swapped or reclaimed, and pinning them only shrinks what the
node has left. The pinned buffers are allocated at their exact size (see [Note: exact-size pinned
memory] in runtime/streams.py); ``pinned_bytes`` is what they lock, reported in profiles.

[Note: offload copies]
Gradients, device -> host: when a bucket's reduction completes, the reducer calls ``push`` with the
rank's reduced slice. The copy stream first waits on the compute stream (on which the reduction's
wait was ordered), so the copy reads the reduced values; it copies into ``staging`` without blocking
the host and records an event. Backward goes on meanwhile. The device memory the copy reads must not
be written before the event: the reducer keeps a staging buffer it pooled back out of reuse until the
compute stream has waited on that event (``order_after``: the caching allocator cannot see reuse
within our own pool), ``record_stream`` keeps the caching allocator from handing the block to a new
tensor if the reducer drops it (pool trimming, the local accumulator) before the copy is done, and the
stages 0-1 gradient buffer is written again only after ``drain``.

Each push also queues the slice's fold on the fold thread (one host thread per engine): it waits for
that copy's event (releasing the GIL) and folds the staged slice into ``grad`` as soon as it lands,
while backward goes on: ADD at stages 2-3 (the device slice holds one backward's sum, the host holds
the step's), REPLACE at stages 0-1 (the device buffer holds the running sum, see [Note: gradient sums]).
One thread, first in first out, so folds run in push order, exactly the adds the host did before.
``drain`` (end of a synchronizing backward, the step's pending reduction, or a zero-bubble weight
pass's ``reduce_added``) only waits for the folds still queued, usually the last bucket's. A bucket
pushed again before its fold ran (stage-3 late gradients) waits for that fold first, so no staged slice
is overwritten before it was folded. The thread touches ``grad`` slices and the set of slices holding
this step's gradients; the training thread reads them only after ``drain``.

Parameters, host -> device (``upload``): the copy stream waits on the compute stream (backward may
still read the parameters), a 16-bit slice is cast on the host into ``staging`` and copied without
blocking into the device parameters, and the compute stream waits on the copy's event before the
caller launches that bucket's all-gather: the copy of bucket k+1 overlaps the gather of bucket k; at
stage 3 every later gather is ordered after the copies into the shard. Before the host writes master
weights or ``staging`` again (the next step), ``wait_uploads`` waits for the copy stream.

The host step: torchrun sets ``OMP_NUM_THREADS=1`` for every rank, so the fused CPU optimizer would
step on one core while the node's others idle. ``host_step_threads`` raises torch's intra-op threads to
the rank's share of the cores it may run on (``cores // LOCAL_WORLD_SIZE``, never fewer than it had)
for the optimizer step only, and restores them after: the ranks of a node share its cores, none takes
all of them.

On a CPU device there is no copy stream, pinning or event (runtime/streams.py's ``SideStream`` is
synchronous there): copies are plain and synchronous, folds still run on the fold thread, so the same
code path runs (and is tested) on CPU when forced with ``FORCE_ENV``.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from hfzero.devices import with_index
from hfzero.logging import get_logger
from hfzero.runtime.layout import Bucket, FlatLayout
from hfzero.runtime.streams import Event, SideStream, pinned_empty, pinned_nbytes, wait_host

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


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity mask, which cgroups and launchers narrow)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def host_step_threads(cores: int, local_world_size: int, current: int) -> int:
    """Intra-op threads for the offloaded host step: the rank's share of the node's ``cores``
    (``cores // local_world_size``), never fewer than the ``current`` setting (a user's choice stands)."""
    return max(current, cores // max(1, local_world_size), 1)


class HostOffload:
    """The host side of an offloaded shard; see the module docstring and [Note: offload copies].

    Attributes:
        pin_plan: which host buffers DMA touches and are therefore pinned on CUDA ("staging", "master");
            "grad" and "states" are listed as False: only the host reads them.
        step_threads: intra-op threads of the host step (see ``host_step_threads``).
    """

    def __init__(self, layout: FlatLayout, device: torch.device, param_dtype: torch.dtype, accumulate: bool,
                 master_dtype: torch.dtype = torch.float32):
        """``accumulate``: True at stages 2-3 (host ADDs each reduction), False at stages 0-1 (REPLACE)."""
        self.layout = layout
        self.device = with_index(device)
        """The rank's device with its index (the fold thread sets it): See [Note: device index] in hfzero/devices.py."""
        self.pinned = self.device.type == "cuda"
        """Whether buffers flagged in ``pin_plan`` are page-locked (CUDA devices)."""
        self.accumulate = accumulate
        self.pin_plan = {"staging": True, "master": master_dtype == param_dtype, "grad": False, "states": False}
        self.copies = SideStream(self.device)
        self.copy_stream = self.copies.stream
        self._pinned_bytes = 0
        self.grad = torch.empty(layout.shard_numel, dtype=torch.float32)
        self.staging = self.empty(layout.shard_numel, param_dtype, pin=self.pin_plan["staging"])
        self._folds: dict[int, Future] = {}  # bucket index -> its fold, queued or done, not yet drained
        self._folder: ThreadPoolExecutor | None = None
        self._holds: set[int] = set()  # buckets whose ``grad`` slice holds gradients of this step
        self.step_threads = host_step_threads(usable_cores(), int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
                                              torch.get_num_threads())
        self.pushed = 0
        """Slices copied to the host since construction (tests check the path ran)."""
        self.fold_order: list[int] = []
        """Bucket indices in the order the fold thread folded them since the last ``reset`` (tests)."""

    def empty(self, numel: int, dtype: torch.dtype, *, pin: bool = False) -> torch.Tensor:
        """An uninitialized host tensor; page-locked at its exact size when ``pin`` and the device is CUDA."""
        pin = pin and self.pinned
        if pin:
            self._pinned_bytes += pinned_nbytes(numel, dtype)
        return pinned_empty(numel, dtype, pin=pin)

    def empty_master(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """The host master weights: pinned when the upload copies them as they are (``pin_plan``)."""
        return self.empty(numel, dtype, pin=self.pin_plan["master"])

    def _slice(self, flat: torch.Tensor, bucket: Bucket) -> torch.Tensor:
        return flat[bucket.shard_offset: bucket.shard_offset + bucket.chunk]

    # ---- gradients, device -> host --------------------------------------------------------------
    def push(self, bucket: Bucket, reduced: torch.Tensor) -> Event | None:
        """Start copying ``reduced`` (this rank's reduced slice of ``bucket``) into host staging and queue
        its fold into ``grad``.

        Returns the event after which the device memory of ``reduced`` may be written (None on CPU).
        """
        earlier = self._folds.get(bucket.index)
        if earlier is not None:
            earlier.result()  # its staged slice is read by that fold: See [Note: offload copies]
        target = self._slice(self.staging, bucket)
        self.pushed += 1
        self.copies.after_compute()
        with self.copies.run():
            target.copy_(reduced, non_blocking=True)
        done = self.copies.record()
        self.copies.keep_alive(reduced)  # a buffer the reducer drops is not reallocated under the copy
        if self._folder is None:
            self._folder = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hfzero-offload-fold",
                                              initializer=self._fold_thread_device)
        self._folds[bucket.index] = self._folder.submit(self._fold, bucket, done)
        return done

    def _fold_thread_device(self) -> None:
        """The fold thread's initializer: make the rank's device current there (a new thread's is device 0), so
        that waiting for its events touches no other device. ``self.device`` has an index: set_device needs one."""
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)

    def _fold(self, bucket: Bucket, done: Event | None) -> None:
        """On the fold thread: wait for the slice's copy, then ADD or REPLACE it into ``grad``."""
        wait_host(done)
        grad, staged = self._slice(self.grad, bucket), self._slice(self.staging, bucket)
        if self.accumulate and bucket.index in self._holds:
            grad.add_(staged)
        else:
            grad.copy_(staged)
        self._holds.add(bucket.index)
        self.fold_order.append(bucket.index)

    def order_after(self, done: Event | None) -> None:
        """Make later compute-stream work wait for ``done`` (a device-side wait; the host goes on)."""
        self.copies.compute_waits(done)

    def drain(self) -> None:
        """Wait for the folds still queued (in push order); afterwards ``grad`` holds every pushed slice."""
        folds, self._folds = list(self._folds.values()), {}
        for fold in folds:
            fold.result()  # re-raises what failed on the fold thread

    def gradient(self, bucket: Bucket) -> torch.Tensor:
        """The host fp32 gradient sum of this rank's slice of ``bucket`` (zeros if nothing arrived)."""
        grad = self._slice(self.grad, bucket)
        if bucket.index not in self._holds:
            grad.zero_()
            self._holds.add(bucket.index)
        return grad

    def reset(self) -> None:
        """Forget this step's gradients (after the step, zero_grad or an aborted pass)."""
        self.drain()
        self._holds.clear()
        self.fold_order.clear()

    # ---- parameters, host -> device -------------------------------------------------------------
    def begin_upload(self) -> None:
        """Order the coming parameter copies after the compute stream's work (which may read them)."""
        self.copies.after_compute()

    def upload(self, bucket: Bucket, master: torch.Tensor, target: torch.Tensor) -> None:
        """Copy ``master`` (host fp32) into the device parameters ``target``; the compute stream waits
        for it, so a collective launched next on ``target`` reads the new values."""
        source = master if master.dtype == target.dtype else self._slice(self.staging, bucket).copy_(master)
        with self.copies.run():
            target.copy_(source, non_blocking=True)
        self.order_after(self.copies.record())

    def wait_uploads(self) -> None:
        """Block until every copy issued so far is done: the host may write masters and staging again."""
        self.copies.synchronize()

    @contextlib.contextmanager
    def host_step(self) -> Iterator[None]:
        """Run the enclosed host optimizer step on ``step_threads`` intra-op threads, restored after."""
        before = torch.get_num_threads()
        if before == self.step_threads:
            yield
            return
        torch.set_num_threads(self.step_threads)
        try:
            yield
        finally:
            torch.set_num_threads(before)


    # ---- accounting -----------------------------------------------------------------------------
    def grad_bytes(self) -> int:
        return self.grad.numel() * self.grad.element_size()

    def staging_bytes(self) -> int:
        return self.staging.numel() * self.staging.element_size()

    def pinned_bytes(self) -> int:
        """Page-locked host bytes this offload allocated (0 off CUDA): staging, and fp32 master weights."""
        return self._pinned_bytes
