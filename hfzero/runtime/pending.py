"""A model whose weights are still in the checkpoint: ``from_pretrained`` under sharded loading.

[Note: pending weights]
Under ``hfzero.sharded_init`` (and ``hfzero run --zero_stage 3``, ``ZeroTrainingArguments`` at stage
3) ``from_pretrained`` leaves every parameter it would load on the meta device and attaches a
``PendingWeights`` to the model: for each such parameter *object*, the safetensors file and key its
values are in. Nothing is read but the files' JSON headers. Keying by object, not by name, survives
what scripts do before ``prepare``: tying (one object under two names), PEFT's renaming
(``base_model.model.<name>``, ``.base_layer``), dtype casts (``Module._apply`` keeps the objects).

``hfzero.prepare`` finds the ``PendingWeights`` (``find_pending``) and turns it into a
``WeightSource`` for the model as it is then (``source``): parameters still pending are read from
their file, range by range, into this rank's shard (stage 3) or whole, one at a time (stages 0-2);
parameters that became real in between (keys the checkpoint lacked, which transformers initialized;
a resized embedding; a LoRA matrix) are taken by value; parameters a wrapper added on meta are
initialized as ``from_pretrained_sharded(wrap=...)`` does.

Between ``from_pretrained`` and ``prepare`` a pending parameter has no values. ``model.to(device)`` /
``.to(dtype)`` / ``.half()`` work (they change the dtype and record nothing else; see
``_pending_apply``). Anything that reads values fails, never with empty values: a pending parameter
is a ``PendingParameter`` (its class is switched in place, so the object and its ties are the same),
whose ``__torch_function__`` runs each op as torch would and turns torch's meta-tensor errors
(``Cannot copy out of meta tensor``, ``item() cannot be called on meta tensors``, ...) into one that
says why there are no values and what to do (``PENDING_HELP``); meta results of its ops carry the same
guard (``PendingTensor``), so ``p.sum().item()`` gets it too; a module holding one refuses its forward
(a pre-hook) with the same message. The class costs one Python call per op on
those parameters, and only while they are pending: reading them in (``swap_tensors`` with a plain
``nn.Parameter``) gives the object its class back, and ``release`` (the end of ``prepare``) resets any
parameter of the model still of that class and removes the hooks, so training never meets either.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Iterable

import torch
from torch import nn
from torch.utils._pytree import tree_map

from hfzero.logging import get_logger
from hfzero.runtime.stage3.weights import SafetensorsFile, WeightLoadError, WeightSource, init_added_values

logger = get_logger(__name__)

PENDING_ATTR = "_hfzero_pending_weights"

PENDING_HELP = (
    "it was loaded by from_pretrained under hfzero's sharded loading (hfzero run --zero_stage N, "
    "ZeroTrainingArguments, or hfzero.sharded_init), which leaves every weight in the checkpoint until "
    "hfzero.prepare (ZeroTrainer, ZeroAccelerator.prepare) reads each rank's part of it, so it has no values "
    "yet. Read weights after prepare (at stage 3 with hfzero.full_state_dict, a collective), or load this model "
    "outside sharded loading")
"""Why a pending parameter has no values and what to do; the message of every refused read."""


def _pending_error(exc: Exception, args: tuple) -> Exception:
    names = [a.__dict__.get("_hfzero_key") for a in args if isinstance(a, torch.Tensor)]
    what = next((f"weight {n!r}" for n in names if n), "a weight")
    return type(exc)(f"hfzero: cannot read the values of {what} before hfzero.prepare: {PENDING_HELP}. "
                     f"(torch: {exc})")


def _guarded(out):
    if isinstance(out, torch.Tensor) and out.device.type == "meta" and not isinstance(out, PendingTensor):
        return out.as_subclass(PendingTensor)
    return out


def _pending_torch_function(cls, func, types, args=(), kwargs=None):
    """Run ``func`` as torch would; a meta-tensor refusal becomes the pending-weights error (see
    [Note: pending weights]); meta results keep the guard."""
    with torch._C.DisableTorchFunctionSubclass():
        try:
            out = func(*args, **(kwargs or {}))
        except (NotImplementedError, RuntimeError, TypeError) as exc:
            if "meta" not in str(exc):
                raise
            raise _pending_error(exc, tuple(args) + tuple((kwargs or {}).values())) from None
    return tree_map(_guarded, out)


class PendingParameter(nn.Parameter):
    """A parameter whose values are still in the checkpoint (on meta): reading them raises a clear error.
    See [Note: pending weights]."""

    __torch_function__ = classmethod(_pending_torch_function)


class PendingTensor(torch.Tensor):
    """A meta result of an op on a PendingParameter: carries the same guard."""

    __torch_function__ = classmethod(_pending_torch_function)


def _refuse_forward(module: nn.Module, args: tuple) -> None:
    """Forward pre-hook of a module holding pending parameters: a forward before prepare would compute on
    meta tensors (and fail somewhere inside with a bare meta-tensor error); fail here, saying why."""
    for name, param in module._parameters.items():
        if isinstance(param, PendingParameter) and param.device.type == "meta":
            key = param.__dict__.get("_hfzero_key", name)
            raise RuntimeError(f"hfzero: cannot run {type(module).__name__}.forward before hfzero.prepare: its "
                               f"weight {key!r} has no values: {PENDING_HELP}")


def _mark(param: nn.Parameter, key: str) -> None:
    if type(param) is nn.Parameter and param.device.type == "meta":
        param.__class__ = PendingParameter
        param.__dict__["_hfzero_key"] = key


def _unmark(param: nn.Parameter) -> None:
    if isinstance(param, PendingParameter):
        param.__class__ = nn.Parameter
        param.__dict__.pop("_hfzero_key", None)


class PendingWeights:
    """Where each meta parameter of a model loaded under sharded loading finds its values.

    Attributes:
        keys: parameter object -> (safetensors path, key in that file).
    """

    def __init__(self, keys: dict[nn.Parameter, tuple[str, str]]):
        self.keys = keys

    def attach(self, model: nn.Module) -> None:
        """Mark ``model`` as pending and let ``model.to(...)`` pass over meta parameters while it is. Also for
        a module made of some of the pending model's submodules (a pipeline stage): ``prepare`` of it then
        reads only its parameters (see [Note: stage-only builds] in parallel/pipeline/driver.py)."""
        model.__dict__[PENDING_ATTR] = self
        _live.add(model)
        for param, (_, key) in self.keys.items():
            _mark(param, key)
        for module in model.modules():
            hooked = any(h is _refuse_forward for h in module._forward_pre_hooks.values())
            if not hooked and any(isinstance(p, PendingParameter) for p in module._parameters.values()):
                module.register_forward_pre_hook(_refuse_forward)
        if nn.Module._apply is not _pending_apply:
            nn.Module._apply = _pending_apply

    def materialize(self, param: nn.Parameter) -> None:
        """Read ``param`` whole now, in place (same object, ties kept); from then on it is taken by value.
        For what must see values before prepare (``resize_token_embeddings`` copying the old rows)."""
        if param.device.type != "meta" or param not in self.keys:
            return
        path, key = self.keys.pop(param)
        handle = SafetensorsFile(path)
        try:
            _, shape, _ = handle.entries[key]
            value = handle.read(key, 0, math.prod(shape)).view(shape).to(param.dtype)
        finally:
            handle.close()
        torch.utils.swap_tensors(param, nn.Parameter(value, requires_grad=param.requires_grad))

    def source(self, model: nn.Module, device: torch.device) -> PendingSource:
        """A WeightSource over ``model``'s canonical parameter names (see [Note: pending weights])."""
        _follow_peft_copies(model, self.keys)
        resolved: dict[str, tuple[str, str, torch.dtype]] = {}  # name -> (path, key, dtype as built)
        values: dict[str, torch.Tensor] = {}
        added: list[tuple[str, nn.Parameter]] = []
        for name, p in model.named_parameters():
            if p in self.keys and p.device.type == "meta":
                resolved[name] = (*self.keys[p], p.dtype)
            elif p.device.type != "meta":
                values[name] = p.detach()  # initialized by transformers or the script: taken by value
                torch.utils.swap_tensors(p, nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"),
                                                         requires_grad=p.requires_grad))
            else:
                added.append((name, p))
        if added:
            values.update(_init_added_in_place(model, added))
        return PendingSource(resolved, values, device)


def _init_added_in_place(model: nn.Module, added: list[tuple[str, nn.Parameter]]) -> dict[str, torch.Tensor]:
    """Initial values of parameters a wrapper added on meta (peft's LoRA matrices), computed by their own
    initializers as ``from_pretrained_sharded(wrap=...)`` does; the optimizer already holds these very
    objects, so they are put back in their modules afterwards."""
    wanted = {p for _, p in added}
    slots = [(m, key, p) for m in model.modules() for key, p in m._parameters.items() if p in wanted]
    try:
        return init_added_values(model, added, seed=0)
    finally:
        for module, key, p in slots:
            module._parameters[key] = p


def find_pending(model: nn.Module) -> PendingWeights | None:
    """The PendingWeights of ``model`` or of a module inside it (a PEFT wrapper holds the base model)."""
    for module in model.modules():
        pending = module.__dict__.get(PENDING_ATTR)
        if pending is not None:
            return pending
    return None


def release(model: nn.Module) -> None:
    """After prepare: the model is no longer pending (its parameters are the engine's, of the plain class)."""
    for module in model.modules():
        if module.__dict__.pop(PENDING_ATTR, None) is not None:
            _live.discard(module)
        for param in module._parameters.values():
            _unmark(param)
        for key in [k for k, hook in module._forward_pre_hooks.items() if hook is _refuse_forward]:
            del module._forward_pre_hooks[key]


_live: weakref.WeakSet[nn.Module] = weakref.WeakSet()
"""Models with pending weights in this process; ``_pending_apply`` acts only while there is one."""
_torch_apply = nn.Module._apply


def _pending_apply(self: nn.Module, fn, recurse: bool = True):
    """``nn.Module._apply`` while a pending model exists: ``model.to(device, dtype)`` converts buffers and
    real parameters as usual and gives meta parameters the new dtype, in place (same objects); their
    device is where ``prepare`` puts them anyway. Real tensors sent to meta keep their values (peft moves
    the adapters it initialized to "the base layer's device"; ``prepare`` takes them by value). Otherwise,
    with no pending model in the process, torch's own."""
    if not _live:
        return _torch_apply(self, fn, recurse)

    def convert(t: torch.Tensor) -> torch.Tensor:
        try:
            out = fn(t)  # real tensors; meta -> meta casts; to_empty
        except NotImplementedError:  # "Cannot copy out of meta tensor": a move to a real device
            if t.device.type != "meta":
                raise
            probe = fn(torch.empty(0, dtype=t.dtype))  # what fn does to a dtype, without touching t
            return torch.empty(t.shape, dtype=probe.dtype, device="meta")
        if out.device.type == "meta" and t.device.type != "meta":
            return t.to(out.dtype)  # "to the base layer's device" (peft's adapters): keep the values
        return out

    return _torch_apply(self, convert, recurse)


def _follow_peft_copies(model: nn.Module, keys: dict[nn.Parameter, tuple[str, str]]) -> None:
    """PEFT's ``modules_to_save`` deep-copies a module (meta parameters included): its copies read the
    original's keys."""
    for module in model.modules():
        original = getattr(module, "original_module", None)
        copies = getattr(module, "modules_to_save", None)
        if not isinstance(original, nn.Module) or not isinstance(copies, nn.ModuleDict):
            continue
        base = dict(original.named_parameters())
        for copy in copies.values():
            for name, p in copy.named_parameters():
                if p not in keys and base.get(name) in keys:
                    keys[p] = keys[base[name]]


class PendingSource(WeightSource):
    """Reads a pending model's parameters: by (file, key) from safetensors, or from held values."""

    def __init__(self, resolved: dict[str, tuple[str, str, torch.dtype]], values: dict[str, torch.Tensor],
                 device: torch.device):
        super().__init__(device)
        self.resolved = resolved
        self.values = values
        self._files: dict[str, SafetensorsFile] = {}

    def read(self, name: str, shape: torch.Size, lo: int, hi: int) -> torch.Tensor:
        if name in self.values:
            return self.values[name].reshape(-1)[lo:hi]
        path, key, dtype = self.resolved[name]
        handle = self._files.get(path)
        if handle is None:
            handle = self._files[path] = SafetensorsFile(path)
        if key not in handle.entries:
            raise WeightLoadError(f"hfzero: {path} no longer holds {key!r} (changed since from_pretrained?)")
        return handle.read(key, lo, hi).to(dtype)  # rounded as from_pretrained(dtype=...) rounds it

    def close(self) -> None:
        for handle in self._files.values():
            handle.close()
        self._files.clear()
        self.values.clear()


def materialize_whole(model: nn.Module, source: WeightSource, names: Iterable[str] | None = None) -> None:
    """Give the meta parameters named ``names`` (default: all) their whole values, one at a time, in place
    (stages 0-2, and stage 3's parameters kept whole). Peak: the parameters so far + one tensor read."""
    wanted = set(names) if names is not None else None
    for name, p in model.named_parameters():
        if p.device.type == "meta" and (wanted is None or name in wanted):
            value = source.read_whole(name, p.shape).to(source.device, p.dtype)
            torch.utils.swap_tensors(p, nn.Parameter(value, requires_grad=p.requires_grad))  # keeps ties
