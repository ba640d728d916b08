"""Measured activation memory: the bytes autograd saves for backward, seen through saved-tensor hooks.

[Note: activation accounting]
``torch.autograd.graph.saved_tensors_hooks`` calls ``pack`` for every tensor an operation saves for
its backward. The accounting's pack returns the tensor inside a small holder and counts the bytes of
the tensor's *storage* once, however many operations save it or views of it (Q, K and V of a fused
projection share one storage; a layer's input is saved by three projections). The holder's
finalizer runs when autograd frees the saved variable (after that node's backward, or when the graph
is dropped), and the storage's count goes down; the storage's bytes leave the live total when its
last holder is gone. So ``live`` is the memory held for backward right now and ``peak`` its maximum.

Not counted: parameters (their storage is a model state, reported under the engine's roles) and
tensors saved while an inner saved-tensor hook is active (torch uses only the innermost hooks): the
inputs that hfzero's checkpoint function stores are counted by that function, as ACT_CHECKPOINT.
Saved tensors of a non-reentrant checkpoint's recomputation are seen by torch's own checkpoint hook
and freed as backward consumes them; they are not counted here (the estimator's "one layer's working
set during recomputation" is not measured by this accounting).
"""

from __future__ import annotations

import weakref
import torch
from torch import nn

from hfzero.roles import MemoryRole
from hfzero.runtime.compile import eager_hook
from hfzero.runtime.tensors import local_tensor


class LiveBytes:
    """Bytes of distinct storages held through holders; ``peak`` is the maximum since ``reset_peak``."""

    def __init__(self) -> None:
        self.live = 0
        self.peak = 0
        self._refs: dict[int, list[int]] = {}  # storage key -> [holders, bytes]

    def hold(self, tensor: torch.Tensor, holder: object) -> None:
        """Count ``tensor``'s storage until ``holder`` is garbage-collected."""
        key = _storage_key(tensor)
        entry = self._refs.get(key)
        if entry is None:
            entry = self._refs[key] = [0, _storage_bytes(tensor)]
            self.live += entry[1]
            self.peak = max(self.peak, self.live)
        entry[0] += 1
        weakref.finalize(holder, self._release, key)

    def _release(self, key: int) -> None:
        entry = self._refs.get(key)
        if entry is None:
            return
        entry[0] -= 1
        if entry[0] == 0:
            del self._refs[key]
            self.live -= entry[1]

    def reset_peak(self) -> None:
        self.peak = self.live


class _Saved:
    """What autograd keeps instead of the tensor; the tensor lives as long as this holder."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


class ActivationAccounting:
    """Measures the bytes saved for backward by ``model``'s forward passes (with gradients enabled).

    Attach it with ``attach()``: a forward pre-hook enters the saved-tensor hooks and a forward hook
    (also called on exceptions) leaves them. Per layer: the bytes each of ``layers`` (default: the
    decoder blocks, the modules of the model's largest ``nn.ModuleList``) added during the last
    forward. An observer: the saved tensors are the same objects autograd would have kept.

    Attributes:
        saved: live and peak bytes saved for backward (see [Note: activation accounting]).
        per_layer: layer name -> bytes its forward added in the last recorded forward.
    """

    def __init__(self, model: nn.Module, layers: dict[str, nn.Module] | None = None,
                 entries: list[nn.Module] | None = None) -> None:
        self.model = model
        self._entries = list(entries) if entries else [model]
        """Modules whose forwards are measured: ``model``, or its parts when they run on their own (the stages
        of a pipeline rank running several: their container's forward never runs)."""
        self.saved = LiveBytes()
        self.per_layer: dict[str, int] = {}
        self._layers = _decoder_layers(model) if layers is None else layers
        self._param_keys = _param_keys(model)
        self._hooks: torch.autograd.graph.saved_tensors_hooks | None = None
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self._layer_start: dict[str, int] = {}

    # ---- lifecycle ------------------------------------------------------------------------------
    def attach(self) -> "ActivationAccounting":
        for entry in self._entries:
            # eager hooks: graph boundaries under torch.compile (See [Note: compiled regions] in runtime/compile.py)
            self._handles.append(entry.register_forward_pre_hook(eager_hook(self._enter), prepend=True))
            self._handles.append(entry.register_forward_hook(eager_hook(self._exit), always_call=True))
        for name, layer in self._layers.items():
            self._handles.append(layer.register_forward_pre_hook(eager_hook(self._layer_begin(name))))
            self._handles.append(layer.register_forward_hook(eager_hook(self._layer_end(name))))
        return self

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def memory_by_role(self) -> dict[MemoryRole, int]:
        """Bytes saved for backward right now (ACTIVATIONS)."""
        return {MemoryRole.ACTIVATIONS: self.saved.live} if self.saved.live else {}

    # ---- hooks ----------------------------------------------------------------------------------
    def _enter(self, module: nn.Module, args: object) -> None:
        if self._hooks is not None or not torch.is_grad_enabled():
            return
        self._param_keys = _param_keys(self.model)
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)
        self._hooks.__enter__()

    def _exit(self, module: nn.Module, args: object, output: object) -> None:
        if self._hooks is None:
            return
        hooks, self._hooks = self._hooks, None
        hooks.__exit__(None, None, None)

    def _pack(self, tensor: torch.Tensor) -> object:
        if isinstance(tensor, nn.Parameter) or tensor.numel() == 0 or _storage_key(tensor) in self._param_keys:
            return tensor
        holder = _Saved(tensor)
        self.saved.hold(tensor, holder)
        return holder

    def _layer_begin(self, name: str):
        def hook(module: nn.Module, args: object) -> None:
            if self._hooks is not None:
                self._layer_start[name] = self.saved.live
        return hook

    def _layer_end(self, name: str):
        def hook(module: nn.Module, args: object, output: object) -> None:
            start = self._layer_start.pop(name, None)
            if start is not None:
                self.per_layer[name] = self.saved.live - start
        return hook


def _unpack(packed: object) -> torch.Tensor:
    return packed.tensor if isinstance(packed, _Saved) else packed  # type: ignore[return-value]


def _param_keys(model: nn.Module) -> set[int]:
    return {_storage_key(p) for p in model.parameters()}


def _storage_key(tensor: torch.Tensor) -> int:
    tensor = local_tensor(tensor)
    try:
        return tensor.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # tensor subclasses without storage: by identity
        return id(tensor)


def _storage_bytes(tensor: torch.Tensor) -> int:
    tensor = local_tensor(tensor)
    try:
        return tensor.untyped_storage().nbytes()
    except (RuntimeError, NotImplementedError):
        return tensor.numel() * tensor.element_size()


def _decoder_layers(model: nn.Module) -> dict[str, nn.Module]:
    """The modules of the model's largest ``nn.ModuleList`` (the decoder blocks of an HF model)."""
    lists = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.ModuleList)]
    if not lists:
        return {}
    name, blocks = max(lists, key=lambda item: len(item[1]))
    return {f"{name}.{i}": block for i, block in enumerate(blocks)}

