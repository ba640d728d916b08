"""Activation checkpointing through hfzero: the checkpoint function transformers' layers call.

[Note: hfzero checkpoints]
transformers checkpoints a decoder layer by calling ``layer._gradient_checkpointing_func(fn, *args)``
(set by ``activation_checkpointing_enable`` / ``gradient_checkpointing_enable``, which the Trainer's
``--gradient_checkpointing`` calls). ``HfzeroCheckpoint`` wraps that function: it runs it (torch's
non-reentrant checkpoint) inside saved-tensor hooks of its own. Non-reentrant checkpoint stores the
layer's tensor inputs as saved tensors *before* it enters its own hook for the layer's body, so our
``pack`` sees exactly the checkpoints (the layer inputs) and nothing of the layer's body; ``unpack``
runs when backward recomputes the layer. What pack stores is decided by the policy:

- default: the input itself, counted (ACT_CHECKPOINT). Inputs that do not require gradients (the
  attention mask every layer shares) are always kept as they are, counted once;
- ``partition`` (P_a): this rank's 1/tp slice of the flattened input (padded to a multiple of tp),
  all-gathered over the tensor-parallel group in unpack. The input of a TP layer is replicated over
  the TP group, so the gathered tensor equals the original bit for bit and gradients are exact;
- ``cpu`` (P_a+cpu): the stored tensor moves to host memory (pinned, asynchronous copy) and back in
  unpack. On a CPU-only host it is already there: logged once;
- ``contiguous`` (MD): the stored tensor is copied into a buffer allocated once per checkpointed
  layer call and reused every step, so long-lived checkpoints never interleave with short-lived
  tensors in the allocator. The k-th checkpoint of a forward uses buffer k; numbering restarts when
  no checkpoint is held (after the backward).

Every rank of a TP group checkpoints the same layers in the same order, so the unpack all-gathers
match. Reentrant checkpointing is refused (the engine's gradient hooks would fire twice).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from hfzero.comm import Communicator
from hfzero.config import ConfigError
from hfzero.logging import get_logger
from hfzero.roles import MemoryRole
from hfzero.runtime.activations.accounting import LiveBytes
from hfzero.runtime.compile import checkpointed_body

logger = get_logger(__name__)

_ATTR = "hfzero_checkpoint"


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointPolicy:
    """How hfzero stores activation checkpoints.

    Attributes:
        partition: P_a: keep a 1/tp slice of each checkpoint per TP rank, all-gathered in backward.
        cpu: P_a+cpu: keep the (partitioned) checkpoints in host memory.
        contiguous: MD: place checkpoints in per-layer buffers allocated once and reused.
    """

    partition: bool = False
    cpu: bool = False
    contiguous: bool = False


class _Stored:
    """The stored form of one checkpoint; alive as long as autograd holds it."""

    __slots__ = ("data", "shape", "dtype", "device", "numel", "partitioned", "__weakref__")

    def __init__(self, data: torch.Tensor, source: torch.Tensor, partitioned: bool) -> None:
        self.data = data
        self.shape, self.dtype, self.device, self.numel = source.shape, source.dtype, source.device, source.numel()
        self.partitioned = partitioned


class HfzeroCheckpoint:
    """A checkpoint function for transformers' layers (see [Note: hfzero checkpoints]).

    Attributes:
        stored: live and peak bytes of the checkpoints held (as stored: sliced, on the host, ...).
        policy: the CheckpointPolicy.
    """

    def __init__(self, policy: CheckpointPolicy, tp_comm: Communicator | None = None,
                 inner: Callable[..., Any] | None = None) -> None:
        if policy.partition and (tp_comm is None or tp_comm.world_size == 1):
            raise ConfigError(_NOTHING_TO_PARTITION)
        self.policy = policy
        self.tp_comm = tp_comm
        self.inner = inner or functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=False)
        _refuse_reentrant(self.inner)
        self.stored = LiveBytes()
        self._buffers: list[torch.Tensor] = []
        self._index = 0
        self._said_cpu = False

    def with_inner(self, inner: Callable[..., Any]) -> "HfzeroCheckpoint":
        """The same policy, measurement and buffers around another checkpoint function."""
        _refuse_reentrant(inner)
        self.inner = inner
        return self

    @torch.compiler.disable(recursive=False)  # See [Note: compiled regions] in runtime/compile.py
    def __call__(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if self.stored.live == 0:
            self._index = 0
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            return self.inner(checkpointed_body(function), *args, **kwargs)

    def memory_by_role(self) -> dict[MemoryRole, int]:
        """Bytes of checkpoints held right now (ACT_CHECKPOINT)."""
        return {MemoryRole.ACT_CHECKPOINT: self.stored.live} if self.stored.live else {}

    # ---- pack / unpack --------------------------------------------------------------------------
    def _pack(self, tensor: torch.Tensor) -> _Stored | torch.Tensor:
        if tensor.numel() == 0 or isinstance(tensor, nn.Parameter):
            return tensor
        if not tensor.requires_grad:  # an attention mask shared by every layer: kept as it is, counted once
            stored = _Stored(tensor, tensor, False)
            self.stored.hold(tensor, stored)
            return stored
        partitioned = self.policy.partition and tensor.is_floating_point()
        data = self._slice(tensor) if partitioned else tensor
        if self.policy.contiguous:
            data = self._into_buffer(data)
        if self.policy.cpu:
            data = self._to_host(data)
        stored = _Stored(data, tensor, partitioned)
        self.stored.hold(data, stored)
        return stored

    def _unpack(self, stored: _Stored | torch.Tensor) -> torch.Tensor:
        if not isinstance(stored, _Stored):
            return stored
        data = stored.data.to(stored.device, non_blocking=True) if self.policy.cpu else stored.data
        if stored.partitioned:
            full = torch.empty(data.numel() * self.tp_comm.world_size, dtype=data.dtype, device=data.device)
            self.tp_comm.all_gather(full, data)
            data = full[: stored.numel]
        return data.view(stored.shape)

    def _slice(self, tensor: torch.Tensor) -> torch.Tensor:
        """This TP rank's chunk of the flattened tensor, padded to a multiple of tp (a copy)."""
        tp, rank = self.tp_comm.world_size, self.tp_comm.rank
        flat = tensor.detach().reshape(-1)  # (numel,)
        chunk = -(-flat.numel() // tp)
        lo, hi = min(rank * chunk, flat.numel()), min((rank + 1) * chunk, flat.numel())
        part = torch.zeros(chunk, dtype=flat.dtype, device=flat.device)
        part[: hi - lo].copy_(flat[lo:hi])
        return part

    def _into_buffer(self, data: torch.Tensor) -> torch.Tensor:
        index, self._index = self._index, self._index + 1
        if index == len(self._buffers):
            self._buffers.append(torch.empty(0, dtype=data.dtype, device=data.device))
        buffer = self._buffers[index]
        if buffer.numel() < data.numel() or buffer.dtype != data.dtype or buffer.device != data.device:
            buffer = self._buffers[index] = torch.empty(data.numel(), dtype=data.dtype, device=data.device)
        return buffer[: data.numel()].view(data.shape).copy_(data)

    def _to_host(self, data: torch.Tensor) -> torch.Tensor:
        if data.device.type == "cpu":
            if not self._said_cpu:
                logger.warning("cpu_checkpointing: the checkpoints are already in host memory (CPU device); "
                               "there is nothing to offload")
                self._said_cpu = True
            return data
        host = torch.empty(data.shape, dtype=data.dtype, device="cpu", pin_memory=True)
        return host.copy_(data, non_blocking=True)


def _refuse_reentrant(function: Callable[..., Any]) -> None:
    if getattr(function, "keywords", {}).get("use_reentrant", False):
        raise ConfigError("hfzero: reentrant activation checkpointing fires gradient hooks twice; pass "
                          "gradient_checkpointing_kwargs={'use_reentrant': False}")


_NOTHING_TO_PARTITION = (
    "hfzero: partition_activations (P_a) splits activation checkpoints over the tensor-parallel group, "
    "where every rank holds the same checkpoint; with tp_size=1 (data parallelism alone) each rank's "
    "checkpoints are of its own batch, so there is nothing to partition. Set tp_size > 1 (a dp x tp mesh) "
    "or drop partition_activations (cpu_checkpointing works without it).")


def enable_checkpointing(model: nn.Module, policy: CheckpointPolicy,
                         tp_comm: Communicator | None = None) -> HfzeroCheckpoint:
    """Route ``model``'s activation checkpointing through hfzero; returns the checkpoint function.

    Layers already checkpointed get the hfzero function now; a later ``activation_checkpointing_enable``
    / ``gradient_checkpointing_enable`` (e.g. the Trainer's ``--gradient_checkpointing``) keeps it,
    wrapped around the function that call passes (so its ``use_reentrant`` is checked).
    Call it once per model; the checkpoint function is ``model.hfzero_checkpoint``.
    """
    if not hasattr(model, "_set_gradient_checkpointing"):
        raise ConfigError(f"hfzero: {type(model).__name__} is not a transformers model with activation "
                          "checkpointing (no _set_gradient_checkpointing)")
    checkpoint = HfzeroCheckpoint(policy, tp_comm)
    setter = model._set_gradient_checkpointing

    @functools.wraps(setter)
    def set_gradient_checkpointing(enable: bool = True, gradient_checkpointing_func: Callable[..., Any] = None,
                                   **kwargs: Any) -> Any:
        if gradient_checkpointing_func is not None:
            gradient_checkpointing_func = checkpoint.with_inner(gradient_checkpointing_func)
        else:
            gradient_checkpointing_func = checkpoint
        return setter(enable=enable, gradient_checkpointing_func=gradient_checkpointing_func, **kwargs)

    model._set_gradient_checkpointing = set_gradient_checkpointing
    for module in model.modules():
        if hasattr(module, "_gradient_checkpointing_func"):
            module._gradient_checkpointing_func = checkpoint
    setattr(model, _ATTR, checkpoint)
    return checkpoint
