"""A model whose weights are still in the checkpoint: ``from_pretrained`` under sharded loading.

[Note: pending weights]
Under ``hfzero.sharded_init`` (and ``hfzero run --zero_stage N``, ``ZeroTrainingArguments``) ``from_pretrained``
leaves every parameter it would load on the meta device and attaches a ``PendingWeights`` to the model: for
each such parameter *object*, the safetensors file and key its values are in. Nothing is read but the files'
JSON headers. Keying by object, not by name, survives what scripts do before ``prepare``: tying (one object
under two names), PEFT's renaming (``base_model.model.<name>``, ``.base_layer``), dtype casts
(``Module._apply`` keeps the objects), deep copies (a copy knows its original's file and key).

A pending model then goes one of two ways, whichever comes first:
- ``hfzero.prepare`` (ZeroTrainer, ZeroAccelerator) finds the ``PendingWeights`` (``find_pending``) and
  turns it into a ``WeightSource`` for the model as it is then (``source``; the weights are *claimed*):
  parameters still pending are read from their file, range by range, into this rank's shard (stage 3) or
  whole, one at a time (stages 0-2); parameters that became real in between (keys the checkpoint lacked,
  which transformers initialized; a resized embedding; a LoRA matrix) are taken by value; parameters a
  wrapper added on meta are initialized as ``from_pretrained_sharded(wrap=...)`` does.
- Anything that needs values first (a forward; an op on a weight that computes, copies, aliases or writes
  it: ``state_dict()``, ``w.sum()``, ``w.cpu()``, ``print(w)``, ``w.data``, ``nn.init.normal_(w)``) loads
  the *whole* model, once, as transformers' ``from_pretrained`` would have (``PendingWeights.load``, with a
  log line), and runs what asked for it on the values. That is how every model a script loads but hfzero
  never prepares (a reference, reward, teacher or evaluation model; a model run before the Trainer is
  built) behaves exactly as under plain transformers.

What does not need values runs on meta and loads nothing, so the prepared model keeps its memory win:
metadata (``shape``, ``dtype``, ``requires_grad``, ``numel()``), ``requires_grad_``, ``model.to(device)`` /
``.to(dtype)`` / ``.half()`` (they change the dtype and record the device the weights go to when loaded: see
``_pending_apply``; transformers' ``model.device`` reports that device), ``copy.deepcopy`` (peft's
``modules_to_save``: the copy is pending too, over the same file and key).

How: a pending parameter is a ``PendingParameter`` (its class is switched in place, so the object and its
ties are the same), whose ``__torch_function__`` runs each op on meta first and loads when the op fails
for want of values or makes a tensor (the op then runs again on the values); a module holding one loads
before its forward (a pre-hook). Once claimed by ``prepare`` (and inside ``_pending_apply``) the class only
guards: torch's meta-tensor errors become one that says why there are no values (``PENDING_HELP``), and
meta results carry the same guard (``PendingTensor``). The class costs one Python call per op on those
parameters, and only while they are pending: reading them in (``swap_tensors`` with a plain
``nn.Parameter``) gives the object its class back, and ``release`` (the end of ``prepare``, or of a load)
resets any parameter of the model still of that class and removes the hooks, so training never meets
either. Nothing here keeps a model alive: a parameter reaches its ``PendingWeights`` and the
``PendingWeights`` its model through weak references, and the hook is a plain function.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import weakref
from collections.abc import Iterable, Iterator

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from hfzero.logging import get_logger
from hfzero.runtime.stage3.weights import SafetensorsFile, WeightLoadError, WeightSource, init_added_values

logger = get_logger(__name__)

PENDING_ATTR = "_hfzero_pending_weights"
_KEY = "_hfzero_key"
"""On a pending parameter: its checkpoint key (for messages)."""
_OWNER = "_hfzero_owner"
"""On a pending parameter: a weak reference to its PendingWeights."""
_DEVICE = "_hfzero_device"
"""On a pending parameter: the device ``.to()`` sent it to (its values go there when loaded)."""
_SOURCE = "_hfzero_source"
"""On a deep copy of a pending parameter: the (file, key) of its original."""

PENDING_HELP = (
    "it was loaded by from_pretrained under hfzero's sharded loading (hfzero run --zero_stage N, "
    "ZeroTrainingArguments, or hfzero.sharded_init), which leaves every weight in the checkpoint until "
    "hfzero.prepare (ZeroTrainer, ZeroAccelerator.prepare) reads each rank's part of it, so it has no values "
    "yet. Read weights after prepare (at stage 3 with hfzero.full_state_dict, a collective), or load this model "
    "outside sharded loading")
"""Why a claimed pending parameter (inside prepare) has no values; the message of every refused read."""

_quiet = 0
"""> 0 while hfzero itself handles pending parameters (``_pending_apply``, a load): ops on them only guard."""


@contextlib.contextmanager
def _quietly() -> Iterator[None]:
    global _quiet
    _quiet += 1
    try:
        yield
    finally:
        _quiet -= 1


def _pending_error(exc: Exception, args: tuple) -> Exception:
    names = [a.__dict__.get(_KEY) for a in args if isinstance(a, torch.Tensor)]
    what = next((f"weight {n!r}" for n in names if n), "a weight")
    return type(exc)(f"hfzero: cannot read the values of {what} before hfzero.prepare: {PENDING_HELP}. "
                     f"(torch: {exc})")


def _guarded(out):
    guarded = isinstance(out, (PendingTensor, nn.Parameter))  # already, or a weight itself (``w.float()`` is ``w``)
    if isinstance(out, torch.Tensor) and out.device.type == "meta" and not guarded:
        return out.as_subclass(PendingTensor)
    return out


def _owner(param: torch.Tensor) -> PendingWeights | None:
    """The PendingWeights that can still load ``param`` (alive, not claimed by prepare), or None."""
    ref = param.__dict__.get(_OWNER)
    owner = ref() if ref is not None else None
    return owner if owner is not None and not owner.claimed and owner.model() is not None else None


_INPLACE_DUNDERS = frozenset({"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__",
                              "__imod__", "__ipow__", "__iand__", "__ior__", "__ixor__", "__ilshift__",
                              "__irshift__", "__imatmul__"})
_NOT_WRITES = frozenset({"requires_grad_", "share_memory_", "retain_grad"})
_SHOWS = frozenset({"__repr__", "__str__", "__format__"})
"""Ops that print values (a string on meta, no error): they read."""


def _writes(func, kwargs: dict) -> bool:
    """Whether ``func`` writes into its tensor arguments (``copy_``, ``normal_``, ``w[0] = ...``, ``out=``): on a
    pending weight it must write into the values, so they are loaded first."""
    name = getattr(func, "__name__", "")
    if name in _INPLACE_DUNDERS or kwargs.get("out") is not None:
        return True
    return name.endswith("_") and not name.endswith("__") and name not in _NOT_WRITES


def _makes_tensor(out, args: list) -> bool:
    """Whether ``out`` holds a tensor that is not one of the op's own arguments (a result computed from, copied
    from or aliasing a weight: it would hold no values on meta)."""
    inputs = {id(a) for a in args if isinstance(a, torch.Tensor)}
    leaves, _ = tree_flatten(out)
    return any(isinstance(t, torch.Tensor) and id(t) not in inputs for t in leaves)


def _pending_torch_function(cls, func, types, args=(), kwargs=None):
    """Run ``func`` as torch would. On a pending weight that can still load (see [Note: pending weights]): an
    op that needs values loads the model whole first, then runs on the values. Otherwise (claimed by prepare,
    or hfzero's own handling) a meta-tensor refusal becomes the pending-weights error and meta results keep
    the guard."""
    kwargs = kwargs or {}
    flat, _ = tree_flatten((args, kwargs))
    owners = {} if _quiet else {id(o): o for o in map(_owner, (a for a in flat if isinstance(a, PendingParameter)))
                                if o is not None}
    what = getattr(func, "__name__", str(func))
    if owners and _writes(func, kwargs):
        return _load_then(f"{what} writes into a weight", func, args, kwargs)
    needs_values = False
    with torch._C.DisableTorchFunctionSubclass():
        try:
            out = func(*args, **kwargs)
        except (NotImplementedError, RuntimeError, TypeError) as exc:
            if "meta" not in str(exc):
                raise
            if not owners:
                raise _pending_error(exc, tuple(flat)) from None
            needs_values, out = True, None
    if owners and (needs_values or what in _SHOWS or _makes_tensor(out, flat)):
        del out  # a meta view of a weight holds it: swapping its values in needs it free
        return _load_then(f"{what} reads a weight", func, args, kwargs)
    return tree_map(_guarded, out)


def _load_then(why: str, func, args, kwargs):
    flat, _ = tree_flatten((args, kwargs))
    _load_for([a for a in flat if isinstance(a, PendingParameter)], why)
    return func(*args, **kwargs)  # the same parameter objects, now holding values


def _load_for(params: list[nn.Parameter], why: str) -> None:
    """Give ``params`` their values: a parameter of its owner's model loads that model whole (``load``); a deep
    copy outside it (a module copied out of a pending model and used alone) is read alone, from its original's
    file and key, and leaves the model pending."""
    for p in params:
        owner = _owner(p) if isinstance(p, PendingParameter) else None
        if owner is None or p.device.type != "meta":
            continue
        if owner.holds(p):
            owner.load(why)
        else:
            owner.read_alone(p)


class PendingParameter(nn.Parameter):
    """A parameter whose values are still in the checkpoint (on meta): see [Note: pending weights]."""

    __torch_function__ = classmethod(_pending_torch_function)

    def __deepcopy__(self, memo: dict) -> nn.Parameter:
        """A pending copy over the same file and key (peft's ``modules_to_save`` copies modules before prepare);
        copying the whole model copies its PendingWeights too (``PendingWeights.__deepcopy__``)."""
        if id(self) in memo:
            return memo[id(self)]
        with _quietly():
            if self.device.type != "meta":  # read in already: an ordinary copy
                return nn.Parameter.__deepcopy__(self, memo)
            twin = nn.Parameter(torch.empty(self.shape, dtype=self.dtype, device="meta"),
                                requires_grad=self.requires_grad)
        twin.__class__ = PendingParameter
        owner_ref = self.__dict__.get(_OWNER)
        owner = owner_ref() if owner_ref is not None else None
        where = owner.where(self) if owner is not None else None
        for attr in (_KEY, _OWNER, _DEVICE):
            if attr in self.__dict__:
                twin.__dict__[attr] = self.__dict__[attr]
        if where is not None:
            twin.__dict__[_SOURCE] = where
        memo[id(self)] = twin
        return twin


class PendingTensor(torch.Tensor):
    """A meta result of an op on a claimed PendingParameter: carries the same guard."""

    __torch_function__ = classmethod(_pending_torch_function)


def _load_before_forward(module: nn.Module, args: tuple) -> None:
    """Forward pre-hook of a module holding pending parameters: a forward needs values, so the model is loaded
    whole (see [Note: pending weights]); claimed by a prepare in progress, the forward is refused."""
    for name, param in module._parameters.items():
        if isinstance(param, PendingParameter) and param.device.type == "meta":
            owner = _owner(param)
            if owner is None or _quiet:
                key = param.__dict__.get(_KEY, name)
                raise RuntimeError(f"hfzero: cannot run {type(module).__name__}.forward before hfzero.prepare: its "
                                   f"weight {key!r} has no values: {PENDING_HELP}")
            _load_for(list(module.parameters()), f"{type(module).__name__}.forward ran")
            release(module)  # a module copied out of the model keeps no hook either
            return


def _mark(param: nn.Parameter, key: str, owner: PendingWeights) -> None:
    if type(param) is nn.Parameter and param.device.type == "meta":
        param.__class__ = PendingParameter
        param.__dict__[_KEY] = key
    if isinstance(param, PendingParameter):
        param.__dict__[_OWNER] = weakref.ref(owner)


def _unmark(param: nn.Parameter) -> None:
    if isinstance(param, PendingParameter):
        param.__class__ = nn.Parameter
        for attr in (_KEY, _OWNER, _DEVICE, _SOURCE):
            param.__dict__.pop(attr, None)


def intended_device(param: nn.Parameter) -> torch.device:
    """Where a pending parameter's values go when loaded: the device ``.to()`` last sent it to, else where
    ``from_pretrained`` would have put it (its ``device_map``'s one device, or the CPU)."""
    recorded = param.__dict__.get(_DEVICE)
    if recorded is not None:
        return recorded
    ref = param.__dict__.get(_OWNER)
    owner = ref() if ref is not None else None
    return owner.device if owner is not None else torch.device("cpu")


class PendingWeights:
    """Where each meta parameter of a model loaded under sharded loading finds its values.

    Attributes:
        keys: parameter object -> (safetensors path, key in that file).
        device: where a load puts values by default (``from_pretrained``'s one ``device_map`` device, or the CPU).
        claimed: ``prepare`` took the weights (``source``): they are no longer loaded on use.
    """

    def __init__(self, keys: dict[nn.Parameter, tuple[str, str]], device: torch.device | str | None = None):
        self.keys = keys
        self.device = torch.device(device if device is not None else "cpu")
        self.claimed = False
        self._model: weakref.ref[nn.Module] | None = None

    def model(self) -> nn.Module | None:
        """The module this is attached to, while it lives."""
        return self._model() if self._model is not None else None

    def where(self, param: nn.Parameter) -> tuple[str, str] | None:
        """(file, key) of ``param``'s values: its own, or its original's for a deep copy."""
        return self.keys.get(param) or param.__dict__.get(_SOURCE)

    def attach(self, model: nn.Module) -> None:
        """Mark ``model`` as pending and let ``model.to(...)`` pass over meta parameters while it is. Also for
        a module made of some of the pending model's submodules (a pipeline stage): ``prepare`` of it then
        reads only its parameters (see [Note: stage-only builds] in parallel/pipeline/driver.py)."""
        model.__dict__[PENDING_ATTR] = self
        self._model = weakref.ref(model)
        _live.add(model)
        for param, (_, key) in self.keys.items():
            _mark(param, key, self)
        for module in model.modules():
            hooked = any(h is _load_before_forward for h in module._forward_pre_hooks.values())
            if not hooked and any(isinstance(p, PendingParameter) for p in module._parameters.values()):
                module.register_forward_pre_hook(_load_before_forward)
        if nn.Module._apply is not _pending_apply:
            nn.Module._apply = _pending_apply

    def __deepcopy__(self, memo: dict) -> PendingWeights:
        """``copy.deepcopy`` of a pending model: the copy is pending over the same files (the parameters' own
        copies come from ``memo``; see ``PendingParameter.__deepcopy__``)."""
        clone = PendingWeights({}, self.device)
        memo[id(self)] = clone
        for param, where in self.keys.items():
            new = copy.deepcopy(param, memo)
            clone.keys[new] = where
            if isinstance(new, PendingParameter):
                new.__dict__[_OWNER] = weakref.ref(clone)
        model = self.model()
        copied = memo.get(id(model)) if model is not None else None
        if copied is not None:  # the module being copied (its __dict__ receives ``clone``)
            clone._model = weakref.ref(copied)
            _live.add(copied)
        return clone

    def load(self, why: str, level: int = logging.WARNING) -> None:
        """Read every pending parameter of the model whole, in place (same objects, ties kept), in its dtype and
        on its ``intended_device``, as ``from_pretrained`` would have; then the model is an ordinary one
        (``release``). For a model hfzero never prepares (see [Note: pending weights]). Once: later calls do
        nothing."""
        model = self.model()
        if model is None or self.claimed:
            return
        self.claimed = True  # from here on: no second load, whatever the ops below touch
        with _quietly(), torch.inference_mode(False), torch.no_grad():
            resolved, added, targets = {}, [], []
            for name, p in model.named_parameters():
                if p.device.type != "meta":
                    continue
                where = self.where(p)
                if where is None:
                    added.append((name, p))
                else:
                    resolved[name] = (*where, p.dtype)
                    targets.append((name, p))
            source = PendingSource(resolved, {}, torch.device("cpu"))
            try:
                for name, p in targets:
                    value = source.read_whole(name, p.shape).to(intended_device(p))
                    torch.utils.swap_tensors(p, nn.Parameter(value, requires_grad=p.requires_grad))
            finally:
                source.close()
            if added:
                values = _init_added_in_place(model, added)
                for name, p in added:
                    value = values[name].to(intended_device(p), p.dtype)
                    torch.utils.swap_tensors(p, nn.Parameter(value, requires_grad=p.requires_grad))
        release(model)
        nbytes = sum(p.numel() * p.element_size() for _, p in targets)
        logger.log(level, "hfzero: %s was loaded under sharded loading and %s before hfzero prepared it: read its %d "
                   "weight tensor(s) whole (%.1f MiB) as from_pretrained would have; it is an ordinary model from here "
                   "on (hfzero prepares only the models given to ZeroTrainer, ZeroAccelerator.prepare or "
                   "hfzero.prepare; see docs/loading.md, 'Every model a script loads')", type(model).__name__, why,
                   len(targets), nbytes / 2**20)

    def holds(self, param: nn.Parameter) -> bool:
        """Whether ``param`` is a parameter of the model this is attached to (not a copy outside it)."""
        model = self.model()
        return param in self.keys or (model is not None and any(q is param for q in model.parameters()))

    def read_alone(self, param: nn.Parameter) -> None:
        """``param`` (a deep copy outside the model this loaded) whole, in place, on its ``intended_device``."""
        where = self.where(param)
        if where is None:
            return
        with _quietly(), torch.inference_mode(False), torch.no_grad():
            source = PendingSource({"p": (*where, param.dtype)}, {}, torch.device("cpu"))
            try:
                value = source.read_whole("p", param.shape).to(intended_device(param))
            finally:
                source.close()
            torch.utils.swap_tensors(param, nn.Parameter(value, requires_grad=param.requires_grad))

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
        """A WeightSource over ``model``'s canonical parameter names (see [Note: pending weights]); the weights
        are claimed: from here on they are never loaded on use."""
        self.claimed = True
        _follow_peft_copies(model, self.keys)
        resolved: dict[str, tuple[str, str, torch.dtype]] = {}  # name -> (path, key, dtype as built)
        values: dict[str, torch.Tensor] = {}
        added: list[tuple[str, nn.Parameter]] = []
        for name, p in model.named_parameters():
            where = self.where(p)
            if where is not None and p.device.type == "meta":
                resolved[name] = (*where, p.dtype)
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
    """After prepare (or a load): the model is no longer pending (its parameters are of the plain class, its
    modules without the forward hook)."""
    for module in model.modules():
        if module.__dict__.pop(PENDING_ATTR, None) is not None:
            _live.discard(module)
        for param in module._parameters.values():
            _unmark(param)
        for key in [k for k, hook in module._forward_pre_hooks.items() if hook is _load_before_forward]:
            del module._forward_pre_hooks[key]


_live: weakref.WeakSet[nn.Module] = weakref.WeakSet()
"""Models with pending weights in this process; ``_pending_apply`` acts only while there is one."""
_torch_apply = nn.Module._apply


def _pending_apply(self: nn.Module, fn, recurse: bool = True):
    """``nn.Module._apply`` while a pending model exists: ``model.to(device, dtype)`` converts buffers and
    real parameters as usual and gives meta parameters the new dtype, in place (same objects), recording a
    move's device on each (a load puts the values there; ``prepare`` puts them on its own device, which is
    the same for a Trainer's model). Real tensors sent to meta keep their values (peft moves
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
            if isinstance(t, PendingParameter):
                t.__dict__[_DEVICE] = probe.device
            return torch.empty(t.shape, dtype=probe.dtype, device="meta")
        if out.device.type == "meta" and t.device.type != "meta":
            return t.to(out.dtype)  # "to the base layer's device" (peft's adapters): keep the values
        return out

    with _quietly():  # ``fn(t)`` on a pending weight: a move, never a read
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
        for duplicate in copies.values():
            for name, p in duplicate.named_parameters():
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
