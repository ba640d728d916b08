"""The host staging buffer of asynchronous checkpoint saves, and the copies into it.

``stage(engine, eager, deferred)`` returns a ``StagedCopies``: views of one host byte buffer, one per tensor,
which the background writer streams to the file while training goes on changing the originals.

- ``eager`` tensors (persistent buffers: a forward may change them; qgZ's error-feedback residuals: a backward
  changes them) are copied before ``stage`` returns.
- ``deferred`` tensors (the rank's fp32 master and optimizer-state slices, RNG states) change only in an
  optimizer step, so the step need not wait for them at the save: on the CPU the background thread copies
  them (``StagedCopies.run``, the first thing it does) while the next forward and backward run, and the next
  optimizer step waits for that copy before it changes them (``ZeroEngine.wait_checkpoint_copy``). On an
  accelerator every copy is issued at the save, asynchronously into pinned memory on the current stream (so
  ordered before the step's kernels: the step need not wait), and the background thread waits for an event
  recorded after them before it writes; the save adds no host sync to the step.

Resident memory: the buffer, exactly the staged bytes (each tensor's start 16-byte aligned), is allocated at
the first asynchronous save and kept on the engine (``engine.checkpoint_staging``) for the next ones, which
reuse it (a larger shard grows it once). Kept across steps, it is a model state, reported as CKPT_STAGING
(host memory).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

from hfzero.runtime.engine import ZeroEngine

_ALIGN = 16
"""Byte alignment of each staged tensor (so a view of any dtype may start there)."""


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def staging_bytes(tensors: Sequence[torch.Tensor]) -> int:
    """Bytes of the staging buffer ``tensors`` need."""
    return sum(_aligned(t.numel() * t.element_size()) for t in tensors)


def _buffer(engine: ZeroEngine, nbytes: int) -> torch.Tensor:
    """The engine's staging buffer, (re)allocated when it is smaller than ``nbytes``."""
    held = engine.checkpoint_staging
    if held is not None and held.numel() >= nbytes:
        return held
    engine.checkpoint_staging = None  # drop the smaller one before allocating its successor
    pin = engine.device.type != "cpu" and torch.accelerator.is_available()
    engine.checkpoint_staging = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
    return engine.checkpoint_staging


def _copy(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Copy each source into its staged view (asynchronously where the source is on an accelerator)."""
    for view, source in pairs:
        view.copy_(source.detach(), non_blocking=True)


class StagedCopies:
    """One save's tensors in the staging buffer: ``eager`` and ``deferred`` views (same dtypes and shapes as
    the sources, contiguous). Until ``run`` has ended (on the background thread), the deferred views may not
    hold their values yet: read them only after ``run``."""

    def __init__(self, engine: ZeroEngine, eager: Sequence[torch.Tensor], deferred: Sequence[torch.Tensor]):
        buffer = _buffer(engine, staging_bytes([*eager, *deferred]))
        views, offset = [], 0
        for tensor in [*eager, *deferred]:
            nbytes = tensor.numel() * tensor.element_size()
            views.append(buffer[offset: offset + nbytes].view(tensor.dtype).view(tensor.shape))
            offset += _aligned(nbytes)
        self.eager, self.deferred = views[:len(eager)], views[len(eager):]
        self._done = threading.Event()
        self._event = None
        device = next((t.device for t in [*eager, *deferred] if t.device.type != "cpu"), None)
        if device is not None:  # every copy issued now, on the current stream, ordered before the next kernels
            _copy(list(zip(views, [*eager, *deferred])))
            self._event = torch.accelerator.current_stream(device).record_event()
            self._pending: list[tuple[torch.Tensor, torch.Tensor]] = []
            self._done.set()  # the step need not wait: stream order protects the sources
        else:
            _copy(list(zip(self.eager, eager)))
            self._pending = list(zip(self.deferred, deferred))

    def run(self) -> None:
        """Background thread, before writing: make every staged view hold its value (CPU: copy the deferred
        tensors; accelerator: wait for the copies' event). Ends the step's wait even if it fails."""
        try:
            if self._event is not None:
                self._event.synchronize()
            _copy(self._pending)
        finally:
            self._pending = []
            self._done.set()

    def wait(self) -> None:
        """Block until the deferred copies are done (the sources may be changed after this)."""
        self._done.wait()
