"""What the engine registers on the user's objects: held so that it never keeps the engine alive, and undone.

[Note: engine lifetime]
``del model, optimizer`` must free the engine and every byte it holds, and ``hfzero.unprepare`` must give the
user back a plain module. Two kinds of link from the user's objects to the engine exist:
- links the garbage collector sees: module hooks (the module's own dicts), attributes set on the model
  (``model.hfzero_engine``, ``model.no_sync``, a wrapped ``generate``), the ZeroOptimizer's ``engine``. The
  model -> engine -> model cycles they make are ordinary Python cycles, collected once the user drops the model
  and the optimizer;
- links torch keeps in C++, out of the collector's sight: a parameter's post-accumulate-grad hooks (the
  reducer's), gradient hooks on forward outputs (stage 3's backward gathers, the profiler's phases), held by the
  autograd graph. A hook there that refers to the engine makes parameter -> hook -> engine -> model ->
  parameter a cycle the collector cannot see whole, so it is never freed: every prepared engine lived, with
  all its memory, until the process exited (the first GPU run found it). Such hooks are ``WeakHook``s: they
  reach their owner through a weak reference and do nothing once it is gone.
The engine's module hooks are ``WeakHook``s too, so nothing the engine leaves on the model (kept by a user
reference to a submodule) holds it. No thread, ``atexit`` hook or module-level registry of hfzero holds an
engine past the work it runs for: the offload's fold thread holds only its queue and device (runtime/offload.py),
an asynchronous checkpoint save's thread holds it until that save ends (hfzero/checkpoint/background.py), a
Pipeline is named by its optimizer's attribute, not a registry (parallel/pipeline/driver.py), and the all-to-all
class expert parallelism registers in transformers reaches its ledger weakly (parallel/expert.py).

Everything ``prepare`` (and the wrappers around it) installs on the user's model is recorded in the engine's
``Installed``: each hook's handle and each patched attribute with the value it replaced. ``unprepare``
(runtime/unprepare.py) removes and restores them in reverse order, so the module it returns carries nothing
of hfzero. ``hfzero.testing.lifetime`` checks both (a weak reference to the engine, a census of live tensors).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

_MISSING = object()


class WeakHook:
    """A hook that calls ``method`` (a bound method) through a weak reference to its owner, with ``bound``
    arguments first; once the owner is gone it does nothing and returns None. See [Note: engine lifetime].

    A plain object with a ``__dict__``: torch may tag a hook with attributes (``register_state_dict_post_hook``
    does), and ``torch.compiler.disable`` wraps it like a function."""

    def __init__(self, method: Callable[..., Any], *bound: Any):
        self._owner = weakref.ref(method.__self__)
        self._function = method.__func__
        self._bound = bound
        self.__name__ = method.__name__
        self.__qualname__ = method.__qualname__  # what torch.compile's graph-break reasons name

    def __repr__(self) -> str:
        return f"<WeakHook {self.__qualname__}{'' if self.alive else ' (owner gone)'}>"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        owner = self._owner()
        if owner is None:
            return None
        if self._bound:
            return self._function(owner, *self._bound, *args, **kwargs)
        return self._function(owner, *args, **kwargs)  # a gradient hook per parameter: no tuple joined per call

    @property
    def alive(self) -> bool:
        """Whether the owner still exists."""
        return self._owner() is not None


class Installed:
    """What was installed on the user's objects, to be undone in reverse order (``undo``).

    Holds the hooks' handles and, for each attribute set on a user object, the object and the value the
    attribute had in its ``__dict__`` before (or that it had none). Holds no tensor memory."""

    def __init__(self) -> None:
        self._undo: list[Callable[[], None]] = []

    def handle(self, handle: Any) -> Any:
        """Record a hook's removable handle (anything with ``remove()``); returns it."""
        self._undo.append(handle.remove)
        return handle

    def set_attr(self, obj: Any, name: str, value: Any) -> None:
        """``setattr(obj, name, value)``, recording what ``obj.__dict__`` held under ``name`` to restore it."""
        previous = obj.__dict__.get(name, _MISSING)
        setattr(obj, name, value)

        def restore() -> None:
            if previous is _MISSING:
                obj.__dict__.pop(name, None)
            else:
                obj.__dict__[name] = previous

        self._undo.append(restore)

    def on_undo(self, fn: Callable[[], None]) -> None:
        """Run ``fn()`` at ``undo`` (after what was recorded later, before what was recorded earlier)."""
        self._undo.append(fn)

    def undo(self) -> None:
        """Remove and restore everything recorded, the latest first; afterwards nothing is recorded."""
        while self._undo:
            self._undo.pop()()
