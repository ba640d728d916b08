"""The host staging buffer of asynchronous checkpoint saves: the only part of such a save that blocks the step.

``stage(engine, tensors)`` copies a rank's tensors (its fp32 master and optimizer-state slices, RNG states,
persistent buffers) into one host byte buffer and returns views of it, which the background writer then
streams to the file while training goes on changing the originals.

Resident memory: the buffer, exactly the staged bytes (each tensor's start 16-byte aligned), is allocated at
the first asynchronous save and kept on the engine (``engine.checkpoint_staging``) for the next ones, which
reuse it (a larger shard grows it once). Kept across steps, it is a model state, reported as CKPT_STAGING
(host memory). On an accelerator the buffer is pinned and the copies are asynchronous, settled by one stream
synchronization per save: the only host sync the save adds to the step.
"""

from __future__ import annotations

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


def stage(engine: ZeroEngine, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of ``tensors`` (same dtypes and shapes, contiguous) in the engine's host staging buffer.

    Returns once every copy is complete, so the caller may change the originals right away.
    """
    buffer = _buffer(engine, staging_bytes(tensors))
    out: list[torch.Tensor] = []
    offset = 0
    on_device = False
    for tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        view = buffer[offset: offset + nbytes].view(tensor.dtype).view(tensor.shape)
        view.copy_(tensor.detach(), non_blocking=True)
        on_device = on_device or tensor.device.type != "cpu"
        out.append(view)
        offset += _aligned(nbytes)
    if on_device:  # the asynchronous device-to-host copies must land before the step changes the sources
        torch.accelerator.current_stream(engine.device).synchronize()
    return out
