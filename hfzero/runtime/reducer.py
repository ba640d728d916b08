"""Gradient reduction during backward: hooks fill buckets, full buckets reduce in a fixed order.

Memory held, by stage (see [Note: bucket sharding] in layout.py):
- stages 0-1: ``grad_full``, one flat gradient buffer shaped like the trainable parameters
  (GRAD_FULL, a model state). Buckets are views of it and are reduced in place.
- stage 2: ``grad_shard``, this rank's slice of every bucket (GRAD_SHARD, a model state), plus
  fixed-size staging buffers for buckets being filled or reduced (GRAD_BUCKET, transient, at most
  the buckets open at once), plus, only while reduction is deferred with ``no_sync``, a full local
  accumulator (GRAD_BUCKET) that is freed by the next synchronizing backward.

[Note: gradient sums]
Stores hold SUMS over ranks, never averages; the division by the world size (and the loss-scale
unscaling) happens once, when the owned slice is converted to fp32 for the step. To keep repeated
backward passes without ``zero_grad`` exact:
- stage 0 all-reduces in place, so every rank holds the full sum S; before the next backward adds to
  it, every rank but rank 0 zeroes its buffer, and the next all-reduce gives exactly S + sum(new).
- stage 1 reduce-scatters in place and zeroes the slices it does not own, so only the owner keeps S.
- stage 2 reduces fresh staging buffers and adds the owned slice into the shard.
"""

from __future__ import annotations

import collections
import contextlib
import enum
from collections.abc import Callable, Iterator

import torch
from torch import nn

from hfzero.comm import Communicator, Handle
from hfzero.logging import get_logger
from hfzero.runtime.layout import Bucket, FlatLayout

logger = get_logger(__name__)


class GradState(enum.Enum):
    """What the gradient store holds.

    EMPTY: zeros (after zero_grad).
    LOCAL: unreduced local contributions (a backward ran under no_sync); reduced before the step.
    REDUCED: sums over all ranks of everything accumulated since zero_grad.
    """

    EMPTY = "empty"
    LOCAL = "local"
    REDUCED = "reduced"


class GradientReducer:
    """Registers post-accumulate-grad hooks and reduces gradients bucket by bucket."""

    def __init__(self, layout: FlatLayout, comm: Communicator, stage: int, dtype: torch.dtype,
                 device: torch.device, overlap: bool, max_inflight: int):
        self.layout = layout
        self.comm = comm
        self.stage = stage
        self.dtype = dtype
        self.device = device
        self.overlap = overlap
        self.max_inflight = max_inflight
        self.sync = True
        self.state = GradState.EMPTY
        self.grad_full: torch.Tensor | None = None
        self.grad_shard: torch.Tensor | None = None
        if stage < 2:
            self.grad_full = torch.zeros(layout.total_padded, dtype=dtype, device=device)
        else:
            self.grad_shard = torch.zeros(layout.shard_numel, dtype=dtype, device=device)
        self.accumulator: torch.Tensor | None = None
        self._staging: dict[int, torch.Tensor] = {}
        self._pool: list[torch.Tensor] = []
        self._pending: list[int] = []
        self._fired: set[nn.Parameter] = set()
        self.used: set[nn.Parameter] = set()
        """Parameters that received a gradient on this rank since the last zero()."""
        self._dirty = False
        self._next_launch = 0
        self._inflight: collections.deque[tuple[Bucket, Handle]] = collections.deque()
        self._in_backward = False
        self.before_first_grad: Callable[[], None] | None = None
        # keyed by RemovableHandle id (an OrderedDict: the handle keeps a weak reference to it)
        self.backward_end_hooks: collections.OrderedDict[int, Callable[[], None]] = collections.OrderedDict()
        self.on_bucket_filled: Callable[[Bucket], None] | None = None
        """Called once per backward when every parameter of a bucket has added its gradient (stage 3
        releases the gathered unit then)."""
        for slot in layout.slots.values():
            slot.param.register_post_accumulate_grad_hook(self._on_grad)

    # ---- switches -------------------------------------------------------------------------------
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally, without communication, for backward passes inside the block.

        Stages 0-1 accumulate into their full gradient buffer; stage 2 allocates a full local
        accumulator (the memory of stage 1) until the next synchronizing backward reduces it.
        """
        previous, self.sync = self.sync, False
        try:
            yield
        finally:
            self.sync = previous

    # ---- hooks ----------------------------------------------------------------------------------
    def _on_grad(self, param: nn.Parameter) -> None:
        grad = param.grad
        param.grad = None
        if grad is None:
            return
        if not self._in_backward:
            self._begin_backward()
        if param in self._fired:
            raise RuntimeError(
                "hfzero: a parameter received two gradients in one backward pass. Reentrant activation "
                "checkpointing (torch.utils.checkpoint with use_reentrant=True) does this; use "
                "use_reentrant=False (e.g. model.gradient_checkpointing_enable("
                "gradient_checkpointing_kwargs={'use_reentrant': False})).")
        self._fired.add(param)
        self.used.add(param)
        self._dirty = True
        slot = self.layout.slots[param]
        bucket = self.layout.buckets[slot.bucket]
        dest = self._fill_target(bucket)
        dest[slot.offset: slot.offset + slot.numel].add_(grad.reshape(-1))
        self._pending[bucket.index] -= 1
        if self._pending[bucket.index] == 0 and self.on_bucket_filled is not None:
            self.on_bucket_filled(bucket)
        if self.sync and self.overlap and self._pending[bucket.index] == 0:
            self._launch_ready()

    def _begin_backward(self) -> None:
        if self.before_first_grad is not None:
            self.before_first_grad()
        if self.state is GradState.REDUCED and self.stage == 0 and self.comm.rank != 0:
            self.grad_full.zero_()  # only rank 0 keeps the sum S: See [Note: gradient sums]
        self._in_backward = True
        self._pending = [len(b.slots) for b in self.layout.buckets]
        self._fired.clear()
        self._next_launch = 0
        torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

    def _end_backward(self) -> None:
        try:
            if self.sync:
                self._launch_all_remaining()
                self._wait_all()
                self.accumulator = None
                self._trim_pool()
                self.state = GradState.REDUCED
            else:
                self.state = GradState.LOCAL
        finally:
            self._in_backward = False
        for hook in list(self.backward_end_hooks.values()):
            hook()

    # ---- buffers --------------------------------------------------------------------------------
    def _fill_target(self, bucket: Bucket) -> torch.Tensor:
        """The bucket-shaped buffer this backward's gradients for ``bucket`` are added into."""
        if self.grad_full is not None:
            return self.grad_full[bucket.offset: bucket.offset + bucket.padded]
        if self.accumulator is not None or not self.sync:
            if self.accumulator is None:
                self.accumulator = torch.zeros(self.layout.total_padded, dtype=self.dtype, device=self.device)
            return self.accumulator[bucket.offset: bucket.offset + bucket.padded]
        staging = self._staging.get(bucket.index)
        if staging is None:
            fitting = [i for i, t in enumerate(self._pool) if t.numel() >= bucket.padded]
            if fitting:
                flat = self._pool.pop(min(fitting, key=lambda i: self._pool[i].numel()))
            else:
                flat = torch.empty(bucket.padded, dtype=self.dtype, device=self.device)
            staging = flat[: bucket.padded].zero_()
            self._staging[bucket.index] = staging
        return staging

    def _release_staging(self, bucket: Bucket) -> None:
        staging = self._staging.pop(bucket.index, None)
        if staging is not None:
            self._pool.append(staging._base if staging._base is not None else staging)

    def _trim_pool(self) -> None:
        """Keep at most ``max_inflight + 1`` staging buffers (the largest) between backward passes.

        A bucket launched late (an unused parameter, ``overlap_comm=False``) keeps later buckets' staging
        open during backward; that peak is transient and is given back here.
        """
        self._pool.sort(key=torch.Tensor.numel, reverse=True)
        del self._pool[self.max_inflight + 1:]

    # ---- reduction ------------------------------------------------------------------------------
    def _launch_ready(self) -> None:
        while self._next_launch < len(self.layout.buckets) and self._pending[self._next_launch] == 0:
            self._launch(self.layout.buckets[self._next_launch])
            self._next_launch += 1

    def _launch_all_remaining(self) -> None:
        while self._next_launch < len(self.layout.buckets):
            self._launch(self.layout.buckets[self._next_launch])
            self._next_launch += 1

    def _launch(self, bucket: Bucket) -> None:
        while len(self._inflight) >= self.max_inflight:
            self._complete(*self._inflight.popleft())
        source = self._fill_target(bucket)
        if self.stage == 0:
            handle = self.comm.all_reduce(source, async_op=True)
        else:
            lo, hi = bucket.owned(self.comm.rank)
            handle = self.comm.reduce_scatter(source[lo:hi], source, async_op=True)
        self._inflight.append((bucket, handle))

    def _complete(self, bucket: Bucket, handle: Handle) -> None:
        handle.wait()
        if self.stage == 0:
            return
        source = self._fill_target(bucket)
        lo, hi = bucket.owned(self.comm.rank)
        if self.stage == 1:
            source[:lo].zero_()  # See [Note: gradient sums]
            source[hi:].zero_()
            return
        self.grad_shard[bucket.shard_offset: bucket.shard_offset + bucket.chunk].add_(source[lo:hi])
        self._release_staging(bucket)  # (an accumulator is dropped whole once every bucket is reduced)

    def _wait_all(self) -> None:
        while self._inflight:
            self._complete(*self._inflight.popleft())

    def reduce_pending(self) -> None:
        """Reduce whatever backward passes under ``no_sync`` left local (before a step or clip)."""
        if self.state is not GradState.LOCAL:
            return
        for bucket in self.layout.buckets:
            self._launch(bucket)
        self._wait_all()
        self.accumulator = None
        self.state = GradState.REDUCED

    # ---- access ---------------------------------------------------------------------------------
    def owned_grad(self, bucket: Bucket) -> torch.Tensor:
        """This rank's reduced gradient SUM for ``bucket`` (a view; valid in the REDUCED state)."""
        if self.grad_shard is not None:
            return self.grad_shard[bucket.shard_offset: bucket.shard_offset + bucket.chunk]
        lo, hi = bucket.owned(self.comm.rank) if self.stage == 1 else (0, bucket.padded)
        return self.grad_full[bucket.offset + lo: bucket.offset + hi]

    def zero(self) -> None:
        """Forget all gradients (the state becomes EMPTY); buffers stay allocated."""
        if self._in_backward:
            raise RuntimeError("hfzero: zero_grad() called during backward")
        self.used.clear()
        if not self._dirty:  # already zero (e.g. zero_grad() right after step(), which zeroed)
            return
        self._dirty = False
        for store in (self.grad_full, self.grad_shard):
            if store is not None:
                store.zero_()
        self.accumulator = None
        self.state = GradState.EMPTY

    def staging_bytes(self) -> int:
        """Bytes of staging buffers and of the deferred-reduction accumulator (GRAD_BUCKET)."""
        element = torch.empty(0, dtype=self.dtype).element_size()
        live = [t._base if t._base is not None else t for t in self._staging.values()]
        staging = sum(t.numel() for t in [*self._pool, *live]) * element
        acc = 0 if self.accumulator is None else self.accumulator.numel() * element
        return staging + acc
