"""The forward pre-hooks by which a unit's submodules gather it when called on their own, taken off while the unit is
in use.

[Note: entry hooks off inside the unit]
A submodule of a stage-3 unit may run outside the unit's forward (``model.get_encoder()(...)``, ``lm_head(h)``, an
embedding called by ``generate``), so each submodule holding some of the unit's gathered parameters carries a
forward pre-hook that gathers the unit then (See [Note: stage-3 gather order] in scheduler.py). Inside the unit's
own forward, the common case by far, that hook has nothing to do, yet its mere presence sends every call of the
submodule through ``nn.Module.__call__``'s slow path (the hook-dispatching ``inner``, several microseconds per
call): six submodules per decoder block of a GPT-2, some 150 calls per step of the host proxy's 24-layer model,
twice that with activation checkpointing. So while a unit is in use (between its pre- and post-forward hooks,
``UnitScheduler._in_use``) its entry hooks are taken out of their modules' hook dicts and put back when it leaves:
inside the unit its submodules take torch's fast path; outside, a standalone call finds its hook as before.

[Note: entry hooks in the backward window]
While the backward pass holds a unit (from reaching it until it is done with it: the pass moves on to the next
unit, or ends), an activation-checkpoint recomputation runs the unit's body, and its submodules should run as in
the forward: with the hooks off. Eagerly that needs nothing ahead: a recomputation through ``Module.__call__`` (as
transformers 5.17's checkpointing layers run it) meets the unit's pre-hook, one that runs the body directly (5.24's)
an entry hook at its first submodule call (one slow-path call per recomputation); either sees the backward pass
holding the unit (reached, not yet done) and only takes the hooks off: a recomputation is no new use of the unit
(the pass's recorded order lists each unit once, so its prefetch and its signature do not depend on checkpointing). A unit without checkpointing, the common case, so never touches its hooks in backward: 25 of the
100 toggles per step of the host proxy's 24-layer model, and the put-backs that went with them. Under regional
compilation (``compile_regions``) the hooks must be off before the body starts: transformers' checkpointing layers
recompute the block's compiled body without ``Module.__call__``, and a compiled body that saw the hooks off in
forward and on in recomputation ran two different graphs, whose saved tensors did not match (CheckpointError). So
when a compiled region runs the unit's body (the unit's module or a submodule carrying its hooks was compiled in
place: ``UnitScheduler._runs_compiled``), the backward pass takes the hooks off as it reaches the unit. Either way
they are back on when the pass is done with the unit.

Putting a hook back restores its place among the module's other pre-hooks (hooks registered after it are moved
behind it again), so the order in which a user's own pre-hooks and hfzero's run never changes. Taking hooks off
happens in hooks of the unit's module (or, for a standalone call, in the submodule's own pre-hook, while torch
iterates a tuple it made of the hooks first, so changing the dict is safe). A pass that raises before the unit's
post-forward leaves its hooks off: the scheduler puts every hook back whenever it clears its in-use stack (a pass's
end, ``abort_pass``). A hook whose handle was removed meanwhile (``unprepare``, or anyone holding it) is not put
back: removing a handle also drops its key from the module's with-kwargs flags, which taking the hook off leaves
alone. Under ``torch.compile`` with the
blocks compiled (``compile_regions``), the unit's pre-hook runs eagerly before the compiled forward, so the
compiled code always sees its submodules without the entry hooks, in forward and in recomputation. Memory: none.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from torch import nn
from torch.utils.hooks import RemovableHandle

_Taken = tuple[dict, dict, int, Callable[..., Any], list[int]]
"""(the module's pre-hook dict, its with-kwargs flags, the hook's key, the hook, the keys registered after it)."""


class EntryHooks:
    """Per unit: the submodules' entry pre-hooks, registered once; ``take_off`` / ``put_back`` around the unit's use."""

    def __init__(self) -> None:
        self._hooks: dict[int, list[tuple[nn.Module, RemovableHandle, int]]] = {}
        """Per unit: (module, the hook's handle, its key in the module's tables)."""
        self._taken: dict[int, list[_Taken]] = {}
        """Units whose hooks are off now -> what to put back."""

    def register(self, index: int, module: nn.Module, hook: Callable[..., Any]) -> RemovableHandle:
        """Register ``hook`` as ``module``'s forward pre-hook (with kwargs) on behalf of unit ``index``."""
        handle = module.register_forward_pre_hook(hook, with_kwargs=True)
        self._hooks.setdefault(index, []).append((module, handle, handle.id))
        return handle

    def modules(self, index: int) -> Iterator[nn.Module]:
        """The submodules carrying unit ``index``'s entry hooks."""
        return (module for module, _, _ in self._hooks.get(index, ()))

    def take_off(self, index: int) -> None:
        """Unit ``index`` is in use: take its entry hooks out of their modules (no-op when already off or none)."""
        hooks = self._hooks.get(index)
        if not hooks or index in self._taken:
            return
        taken = []
        for module, _, key in hooks:
            table = module._forward_pre_hooks
            if len(table) == 1:  # the entry hook alone, the common case: nothing to keep the order of
                hook = table.pop(key, None)
                if hook is not None:
                    taken.append((table, module._forward_pre_hooks_with_kwargs, key, hook, ()))
                continue
            if key not in table:  # removed (unprepare)
                continue
            keys = list(table)  # the keys after it, in the dict's order (a prepended hook may have a larger id)
            taken.append((table, module._forward_pre_hooks_with_kwargs, key, table.pop(key), keys[keys.index(key) + 1:]))
        self._taken[index] = taken

    def put_back(self, index: int) -> None:
        """Unit ``index`` is no longer in use: put its entry hooks back, each at its former place."""
        taken = self._taken.pop(index, None)
        if not taken:
            return
        for table, with_kwargs, key, hook, later in taken:
            if key not in with_kwargs:  # its handle was removed while it was off: it stays removed
                continue
            table[key] = hook
            for other in later:
                if other in table:
                    table.move_to_end(other)

    def put_back_all(self) -> None:
        """Put every unit's entry hooks back (the in-use stack was cleared)."""
        for index in list(self._taken):
            self.put_back(index)

    def remove(self) -> None:
        """Remove every entry hook for good (``unprepare``): hooks off now are dropped, not put back."""
        self._taken.clear()
        for hooks in self._hooks.values():
            for _, handle, _ in hooks:
                handle.remove()
        self._hooks.clear()
