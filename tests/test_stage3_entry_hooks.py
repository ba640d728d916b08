"""Stage 3's entry hooks taken off and put back ([Note: entry hooks off inside the unit] in
hfzero/runtime/stage3/entry_hooks.py): in process, no ranks.

- while off, the module has no pre-hook of hfzero's (torch's fast path) and the user's hooks still run;
- put back, every pre-hook is where it was: one registered before, one after, one prepended after ours;
- a hook removed while off (``unprepare``) is not put back; ``put_back_all`` restores every unit.
"""

from __future__ import annotations

import torch
from torch import nn

from hfzero.runtime.stage3.entry_hooks import EntryHooks


def _order(module: nn.Module) -> list[int]:
    return list(module._forward_pre_hooks)


def test_hooks_come_back_at_their_places_and_only_while_registered():
    calls: list[str] = []

    def user(name):
        return lambda module, args: calls.append(name)

    module = nn.Linear(2, 2)
    module.register_forward_pre_hook(user("before"))
    hooks = EntryHooks()
    ours = hooks.register(0, module, lambda module, args, kwargs: calls.append("ours"))
    module.register_forward_pre_hook(user("after"))
    module.register_forward_pre_hook(user("first"), prepend=True)
    original = _order(module)
    module(torch.zeros(1, 2))
    assert calls == ["first", "before", "ours", "after"]

    hooks.take_off(0)
    hooks.take_off(0)  # already off: no-op
    assert ours.id not in module._forward_pre_hooks and len(module._forward_pre_hooks) == 3
    calls.clear()
    module(torch.zeros(1, 2))
    assert calls == ["first", "before", "after"]

    hooks.put_back(0)
    assert _order(module) == original
    calls.clear()
    module(torch.zeros(1, 2))
    assert calls == ["first", "before", "ours", "after"]

    other = nn.Linear(2, 2)
    second = hooks.register(1, other, lambda module, args, kwargs: None)
    hooks.take_off(0)
    hooks.take_off(1)
    hooks.put_back_all()
    assert _order(module) == original and second.id in other._forward_pre_hooks

    hooks.take_off(0)
    ours.remove()  # unprepare while off
    hooks.put_back(0)
    assert ours.id not in module._forward_pre_hooks
    hooks.remove()
    assert not other._forward_pre_hooks
