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
- ``cpu`` (P_a+cpu): the stored tensor moves to host memory and back in unpack, on a side stream (see
  [Note: checkpoint copies]). On a CPU-only host it is already there: logged once;
- ``contiguous`` (MD): the stored tensor is copied into a buffer allocated once per checkpointed
  layer call and reused every step, so long-lived checkpoints never interleave with short-lived
  tensors in the allocator. The k-th checkpoint of a forward uses buffer k; numbering restarts when
  no checkpoint is held (after the backward).

Every rank of a TP group checkpoints the same layers in the same order, so the unpack all-gathers
match.

[Note: the user's checkpoint settings]
Whatever function transformers sets (``activation_checkpointing_enable`` / ``gradient_checkpointing_enable``,
before or after ``hfzero.prepare``, by hand, by the Trainer's ``--gradient_checkpointing`` or under accelerate)
becomes ``inner``, read by ``_user_settings`` the same way on every path:
- torch's keyword arguments (``preserve_rng_state``, ``context_fn``, ``determinism_check``, ``debug``, ...)
  stay in the function we call, so they are honoured as torch honours them;
- transformers' ``offload=True`` (``save_on_cpu`` around the checkpoint) is honoured as ``cpu`` (P_a+cpu):
  the same placement of the checkpoints in host memory, but measured and with side-stream copies. It cannot
  run as transformers wrote it: its saved-tensor hooks, innermost, would hide the checkpoints from ours;
- ``every_n_layers`` is transformers' own and applies unchanged;
- reentrant checkpointing (``use_reentrant=True``, or a ``torch.utils.checkpoint.checkpoint`` partial that
  leaves it out, which torch runs reentrant) is refused with one ConfigError (``REENTRANT_MESSAGE``): its
  recompute runs a nested backward in which the engine's gradient hooks fire a second time for the
  checkpointed layer's parameters (reducer.py), and its inputs are not saved tensors we can measure.
A function enabled before ``prepare`` is picked up by ``enable_checkpointing``, so it is read then; one
enabled after goes through the wrapped ``_set_gradient_checkpointing``.

[Note: checkpoint copies]
With ``cpu`` the copies run on a side stream (runtime/streams.py), never on the compute stream, and the
host never waits for them:
- pack: the side stream waits for the compute stream (which produced the checkpoint), then copies it
  into host buffer k (the k-th checkpoint of the forward) without blocking. The device tensor is marked
  used on the side stream (``record_stream``): when autograd drops it, the caching allocator does not hand
  its block out again before the copy has read it. Host buffers are pinned at their exact size (see
  [Note: exact-size pinned memory]) and reused every step, like MD's buffers: numbering restarts when no
  checkpoint is held, so buffer k is free again; a copy into it is queued on the same side stream as every
  earlier copy out of it, so the next step's write never overtakes the last step's read. A buffer too
  small for a new checkpoint is replaced, after a host wait for the side stream (its pages are unmapped
  when freed, and the last step's copy out of them may still be running): only when shapes grow.
- unpack (backward's recompute of layer k): the checkpoint's device copy was usually issued already (the
  prefetch below); otherwise it is issued now: a device tensor allocated on the compute stream, filled on
  the side stream after the compute stream's queued work, an event recorded. The compute stream waits on
  that event (a device-side wait) before recompute reads it. Then the previous checkpoint of the forward
  (the next one backward recomputes) is prefetched the same way, so its copy overlaps layer k's recompute
  and backward: at most one checkpoint beyond the one in use is on the device ahead of time. A prefetched
  tensor is marked used on the side stream too, so dropping it unused (an aborted backward) is safe.
On a CPU device ``SideStream`` is synchronous and events are None; the same path runs when forced with
``FORCE_ENV`` (testing), with ordinary host buffers standing for pinned ones.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from hfzero.comm.collectives import Communicator
from hfzero.config import ConfigError
from hfzero.logging import get_logger
from hfzero.roles import MemoryRole
from hfzero.runtime.activations.accounting import LiveBytes
from hfzero.runtime.compile import checkpointed_body
from hfzero.runtime.lifetime import Installed
from hfzero.runtime.streams import Event, SideStream, pinned_empty, pinned_nbytes

logger = get_logger(__name__)

FORCE_ENV = "HFZERO_FORCE_CPU_CHECKPOINTING"
"""Testing only: "1" moves checkpoints through the host path even on a CPU device (plain host buffers,
synchronous copies, the same ordering and prefetch code)."""

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

    __slots__ = ("data", "shape", "dtype", "device", "numel", "partitioned", "host_order", "fetched", "fetched_done",
                 "__weakref__")

    def __init__(self, data: torch.Tensor, source: torch.Tensor, partitioned: bool) -> None:
        self.data = data
        self.shape, self.dtype, self.device, self.numel = source.shape, source.dtype, source.device, source.numel()
        self.partitioned = partitioned
        self.host_order: int | None = None
        """With ``cpu``: the checkpoint's place among the forward's host checkpoints (None: on the device)."""
        self.fetched: torch.Tensor | None = None
        """A device copy issued ahead of unpack (prefetch), and the event after which it is complete."""
        self.fetched_done: Event | None = None


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
        self.configured = policy
        """The policy from ZeroConfig; ``policy`` adds ``cpu`` while the user asked transformers to offload."""
        self.policy = policy
        self.tp_comm = tp_comm
        self.inner: Callable[..., Any] = functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=False)
        self.user_function: Callable[..., Any] | None = None
        """The checkpoint function the user last enabled, as given (before prepare, or through a later
        ``gradient_checkpointing_enable``): what the layers get back at ``unprepare``; None: never enabled."""
        if inner is not None:
            self.with_inner(inner)
        self.stored = LiveBytes()
        self._buffers: list[torch.Tensor] = []
        self._index = 0
        self._said_cpu = False
        self._copies: SideStream | None = None  # See [Note: checkpoint copies]
        self._host_buffers: list[torch.Tensor] = []
        self._hosted: list[weakref.ref[_Stored]] = []  # this forward's host checkpoints, in pack order
        self._pinned_bytes = 0
        self.prefetches = 0
        """Device copies issued ahead of their unpack since construction (tests check the path ran)."""

    def with_inner(self, inner: Callable[..., Any]) -> "HfzeroCheckpoint":
        """The same measurement and buffers around the checkpoint function the user enabled, its settings
        honoured or refused (see [Note: the user's checkpoint settings])."""
        self.user_function = inner.user_function if isinstance(inner, HfzeroCheckpoint) else inner
        self.inner, offload = _user_settings(inner)
        self.policy = dataclasses.replace(self.configured, cpu=self.configured.cpu or offload)
        return self

    @torch.compiler.disable(recursive=False)  # See [Note: compiled regions] in runtime/compile.py
    def __call__(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if self.stored.live == 0:
            self._index = 0
            self._hosted.clear()
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            return self.inner(checkpointed_body(function), *args, **kwargs)

    def memory_by_role(self) -> dict[MemoryRole, int]:
        """Bytes of checkpoints held right now (ACT_CHECKPOINT)."""
        return {MemoryRole.ACT_CHECKPOINT: self.stored.live} if self.stored.live else {}

    def pinned_bytes(self) -> int:
        """Page-locked host bytes of the checkpoint buffers (``cpu`` on CUDA; reused every step)."""
        return self._pinned_bytes

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
        hosted = self.policy.cpu and self._hosts(data)
        if hosted:
            data = self._to_host(data)
        stored = _Stored(data, tensor, partitioned)
        if hosted:
            stored.host_order = len(self._hosted)
            self._hosted.append(weakref.ref(stored))
        self.stored.hold(data, stored)
        return stored

    def _unpack(self, stored: _Stored | torch.Tensor) -> torch.Tensor:
        if not isinstance(stored, _Stored):
            return stored
        data = stored.data
        if stored.host_order is not None:  # See [Note: checkpoint copies]
            if stored.fetched is None:
                self._fetch(stored)
            data, done = stored.fetched, stored.fetched_done
            stored.fetched = stored.fetched_done = None
            self._copies.compute_waits(done)
            self._prefetch_before(stored.host_order)
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

    def _hosts(self, data: torch.Tensor) -> bool:
        """Whether ``data`` goes to host memory (said once when it is there already)."""
        if data.device.type != "cpu" or os.environ.get(FORCE_ENV) == "1":
            return True
        if not self._said_cpu:
            logger.warning("cpu_checkpointing: the checkpoints are already in host memory (CPU device); "
                           "there is nothing to offload")
            self._said_cpu = True
        return False

    def _to_host(self, data: torch.Tensor) -> torch.Tensor:
        """Copy ``data`` into its reused host buffer on the side stream. See [Note: checkpoint copies]."""
        if self._copies is None:
            self._copies = SideStream(data.device)
        index = len(self._hosted)
        pin = data.device.type == "cuda"
        if index == len(self._host_buffers):
            self._host_buffers.append(torch.empty(0, dtype=data.dtype))
        buffer = self._host_buffers[index]
        if buffer.numel() < data.numel() or buffer.dtype != data.dtype:
            if pin and buffer.numel():  # a copy of the last step may still read it: wait before it is freed
                self._copies.synchronize()
                self._pinned_bytes -= pinned_nbytes(buffer.numel(), buffer.dtype)
            buffer = self._host_buffers[index] = pinned_empty(data.numel(), data.dtype, pin=pin)
            if pin:
                self._pinned_bytes += pinned_nbytes(data.numel(), data.dtype)
        host = buffer[: data.numel()].view(data.shape)
        self._copies.after_compute()
        with self._copies.run():
            host.copy_(data, non_blocking=True)
        self._copies.keep_alive(data)
        return host

    def _fetch(self, stored: _Stored) -> None:
        """Issue the device copy of a host checkpoint on the side stream; ``stored.fetched`` holds it."""
        target = torch.empty(stored.data.shape, dtype=stored.data.dtype, device=stored.device)  # compute stream
        self._copies.after_compute()
        with self._copies.run():
            target.copy_(stored.data, non_blocking=True)
        stored.fetched, stored.fetched_done = target, self._copies.record()
        self._copies.keep_alive(target)

    def _prefetch_before(self, order: int) -> None:
        """Prefetch the closest host checkpoint packed before ``order`` that is alive and not yet fetched:
        the one backward recomputes next."""
        for ref in reversed(self._hosted[:order]):
            earlier = ref()
            if earlier is None:
                continue
            if earlier.fetched is None:
                self._fetch(earlier)
                self.prefetches += 1
            return


REENTRANT_MESSAGE = (
    "hfzero: reentrant activation checkpointing (use_reentrant=True, torch's default when use_reentrant is "
    "not given) is not supported: its recompute runs a nested backward that fires the engine's gradient "
    "hooks a second time. Pass use_reentrant=False: gradient_checkpointing_kwargs={'use_reentrant': False} "
    "(TrainingArguments) or model.activation_checkpointing_enable(activation_checkpointing_kwargs="
    "{'use_reentrant': False}); every other torch.utils.checkpoint option and transformers' offload are kept.")


def _is_transformers_offload(function: Callable[..., Any]) -> bool:
    """transformers' ``offload=True`` checkpoint: a local ``checkpoint_func`` of modeling_utils wrapping
    torch's checkpoint in ``save_on_cpu``."""
    return (getattr(function, "__module__", "") == "transformers.modeling_utils"
            and getattr(function, "__qualname__", "").endswith("<locals>.checkpoint_func"))


def _user_settings(function: Callable[..., Any]) -> tuple[Callable[..., Any], bool]:
    """The function hfzero calls for the user's checkpoint function, and whether it asked to offload.
    See [Note: the user's checkpoint settings]."""
    if isinstance(function, HfzeroCheckpoint):
        return function.inner, function.policy.cpu and not function.configured.cpu
    base = function.func if isinstance(function, functools.partial) else function
    keywords = dict(function.keywords) if isinstance(function, functools.partial) else {}
    offload = _is_transformers_offload(base)
    if offload:  # honoured as cpu: torch's checkpoint with the same keywords, our hooks outermost
        base = torch.utils.checkpoint.checkpoint
        function = functools.partial(base, *getattr(function, "args", ()), **keywords)
    torch_default = True if base is torch.utils.checkpoint.checkpoint else None  # torch: absent means reentrant
    if keywords.get("use_reentrant", torch_default) is True:
        raise ConfigError(REENTRANT_MESSAGE)
    return function, offload


_NOTHING_TO_PARTITION = (
    "hfzero: partition_activations (P_a) splits activation checkpoints over the tensor-parallel group, "
    "where every rank holds the same checkpoint; with tp_size=1 (data parallelism alone) each rank's "
    "checkpoints are of its own batch, so there is nothing to partition. Set tp_size > 1 (a dp x tp mesh) "
    "or drop partition_activations (cpu_checkpointing works without it).")


def enable_checkpointing(model: nn.Module, policy: CheckpointPolicy, tp_comm: Communicator | None = None,
                         installed: Installed | None = None) -> HfzeroCheckpoint:
    """Route ``model``'s activation checkpointing through hfzero; returns the checkpoint function.

    Layers already checkpointed get the hfzero function now; a later ``activation_checkpointing_enable``
    / ``gradient_checkpointing_enable`` (e.g. the Trainer's ``--gradient_checkpointing``) keeps it,
    wrapped around the function that call passes (so its ``use_reentrant`` is checked).
    Call it once per model; the checkpoint function is ``model.hfzero_checkpoint``. ``installed``: where the
    changes are recorded for ``unprepare`` (prepare passes its engine's), which gives every layer back the
    function the user last enabled (or what it had before).
    """
    if not hasattr(model, "_set_gradient_checkpointing"):
        raise ConfigError(f"hfzero: {type(model).__name__} is not a transformers model with activation "
                          "checkpointing (no _set_gradient_checkpointing)")
    checkpoint = HfzeroCheckpoint(policy, tp_comm)
    enabled = [m._gradient_checkpointing_func for m in model.modules()
               if getattr(m, "gradient_checkpointing", False) and hasattr(m, "_gradient_checkpointing_func")]
    if enabled:  # enabled before prepare: the same settings as if enabled after it
        checkpoint.with_inner(enabled[0])
    setter = model._set_gradient_checkpointing

    @functools.wraps(setter)
    def set_gradient_checkpointing(enable: bool = True, gradient_checkpointing_func: Callable[..., Any] = None,
                                   **kwargs: Any) -> Any:
        if gradient_checkpointing_func is not None:
            gradient_checkpointing_func = checkpoint.with_inner(gradient_checkpointing_func)
        else:
            gradient_checkpointing_func = checkpoint
        return setter(enable=enable, gradient_checkpointing_func=gradient_checkpointing_func, **kwargs)

    installed = installed or Installed()
    before = [(module, module.__dict__.get(_FUNC, _MISSING)) for module in model.modules() if hasattr(module, _FUNC)]
    installed.on_undo(functools.partial(_restore_functions, model, checkpoint, before))  # undone last
    installed.set_attr(model, "_set_gradient_checkpointing", set_gradient_checkpointing)
    for module, _ in before:
        setattr(module, _FUNC, checkpoint)
    installed.set_attr(model, _ATTR, checkpoint)
    return checkpoint


_FUNC = "_gradient_checkpointing_func"
_MISSING = object()


def _restore_functions(model: nn.Module, checkpoint: HfzeroCheckpoint, before: list[tuple[nn.Module, Any]]) -> None:
    """``unprepare``: every layer that runs ``checkpoint`` gets the function the user last enabled, or, never
    enabled, the one it had before ``enable_checkpointing``."""
    previous = {id(module): value for module, value in before}
    for module in model.modules():
        if module.__dict__.get(_FUNC) is not checkpoint:
            continue
        value = checkpoint.user_function if checkpoint.user_function is not None else previous.get(id(module), _MISSING)
        if value is _MISSING:
            del module.__dict__[_FUNC]
        else:
            module.__dict__[_FUNC] = value
