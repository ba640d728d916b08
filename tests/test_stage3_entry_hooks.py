"""Stage 3's entry hooks taken off and put back ([Note: entry hooks off inside the unit] in
hfzero/runtime/stage3/entry_hooks.py): in process, no ranks.

- while off, the module has no pre-hook of hfzero's (torch's fast path) and the user's hooks still run;
- put back, every pre-hook is where it was: one registered before, one after, one prepended after ours;
- a hook removed while off (``unprepare``) is not put back; ``put_back_all`` restores every unit;
- in the backward window (2 gloo ranks, stage 3, fp32; [Note: entry hooks in the backward window]): without
  activation checkpointing nothing takes a unit's hooks off; with it, the recomputation's first submodule call does,
  once per unit and backward (no new use of the unit: the recorded backward order lists each unit once), the hooks
  are all back after each backward, and both train identically; both ways a recomputation can run: the body
  directly (transformers 5.24's checkpointing layers: it meets an entry hook) and through the unit's
  ``__call__`` (torch's checkpoint of the block, as transformers 5.17 does: it meets the unit's pre-hook).
"""

from __future__ import annotations

import torch
from torch import nn

from hfzero.runtime.stage3.entry_hooks import EntryHooks
from hfzero.testing.spawn import run_distributed


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


class _Stack(nn.Module):
    """Three two-layer blocks (the stage-3 units) and a head; with ``checkpointing`` each block runs under torch's
    non-reentrant checkpoint through its ``__call__``, so the recomputation meets the unit's own pre-hook (what
    transformers 5.17's checkpointing layers do; 5.24's checkpoint the body, which meets an entry hook)."""

    def __init__(self, checkpointing: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.checkpointing = checkpointing
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8)) for _ in range(3))
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False) if self.checkpointing else block(x)
        return self.head(x)


def _train_counting_toggles(rank: int, world: int, kind: str, checkpointing: bool) -> dict:
    import hfzero
    from hfzero.runtime.stage3.scheduler import Phase
    from hfzero.testing.models import tiny_causal_lm

    config = hfzero.ZeroConfig(stage=3, dtype="fp32", param_persistence_threshold=0)
    generator = torch.Generator().manual_seed(rank)
    if kind == "gpt2":
        model = tiny_causal_lm("gpt2", layers=3)
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        model, optimizer = hfzero.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2), config)
        blocks = len(model.transformer.h)

        def loss_of() -> torch.Tensor:
            tokens = torch.randint(0, 64, (2, 12), generator=generator)
            return model(input_ids=tokens, labels=tokens).loss
    else:
        model = _Stack(checkpointing)
        model, optimizer = hfzero.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2), config,
                                          units=["blocks.0", "blocks.1", "blocks.2"])
        blocks = 3

        def loss_of() -> torch.Tensor:
            return model(torch.randn(4, 8, generator=generator)).square().mean()
    scheduler = optimizer.engine.scheduler
    hooks = scheduler.entry_hooks
    taken_in_backward: list[int] = []
    take_off = hooks.take_off

    def counting(index: int) -> None:
        if scheduler.phase is Phase.BACKWARD and index not in hooks._taken:
            taken_in_backward.append(index)
        take_off(index)

    hooks.take_off = counting
    entry = [(module, key) for index in hooks._hooks for module, _, key in hooks._hooks[index]]
    assert entry, "the blocks' submodules carry entry hooks"
    losses, per_backward = [], []
    for _ in range(3):
        before = len(taken_in_backward)
        loss = loss_of()
        loss.backward()
        per_backward.append(len(taken_in_backward) - before)
        assert all(key in module._forward_pre_hooks for module, key in entry), "hooks back on after the backward"
        order = scheduler.orders[Phase.BACKWARD]
        assert len(order) == len(set(order)), f"a recomputation is no new use of its unit: {order}"
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    params = {name: p.detach().clone() for name, p in hfzero.full_state_dict(model).items()}
    return {"losses": losses, "per_backward": per_backward, "blocks": blocks, "params": params}


def _all(rank: int, world: int) -> dict:
    return {(kind, checkpointing): _train_counting_toggles(rank, world, kind, checkpointing)
            for kind in ("gpt2", "calls") for checkpointing in (False, True)}


def test_backward_takes_entry_hooks_off_only_for_a_recomputation():
    for result in run_distributed(_all, 2):
        for kind in ("gpt2", "calls"):
            plain, checkpointed = result[(kind, False)], result[(kind, True)]
            assert plain["per_backward"] == [0, 0, 0], kind
            assert checkpointed["per_backward"] == [checkpointed["blocks"]] * 3, kind  # each block's recomputation
            assert checkpointed["losses"] == plain["losses"], kind
            for name, value in plain["params"].items():
                torch.testing.assert_close(checkpointed["params"][name], value, rtol=1e-6, atol=1e-7)
