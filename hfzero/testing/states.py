"""Per-parameter master weights and optimizer states of a prepared engine, keyed by parameter name.

Tests compare what two engines hold (another layout, world size or stage) through this view, which
is independent of where the flat buffers put each parameter. Holds copies of the rank's own ranges
only (this rank's shard, or the whole model where the layout does not shard).
"""

from __future__ import annotations

import torch

from hfzero.checkpoint.ranges import held_ranges
from hfzero.runtime.engine import ZeroEngine


def held_states(engine: ZeroEngine) -> dict[str, list[tuple[int, int, dict[str, torch.Tensor]]]]:
    """name -> [(start, end, {"master": ..., "<state key>": ...})] for the element ranges this rank holds.

    Scalar optimizer states (Adam's ``step``) are returned under their key as 0-dim copies.
    """
    out: dict[str, list[tuple[int, int, dict[str, torch.Tensor]]]] = {}
    for r in held_ranges(engine.layout, engine.rank):
        view = engine.master_views[r.bucket]
        state = engine.optimizer.state.get(view, {})
        values = {"master": view[r.view_start: r.view_start + r.numel].detach().float().cpu().clone()}
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.shape == view.shape and value.dim() > 0:
                values[key] = value[r.view_start: r.view_start + r.numel].detach().float().cpu().clone()
            elif isinstance(value, torch.Tensor):
                values[key] = value.detach().float().cpu().clone()
        out.setdefault(r.name, []).append((r.start, r.end, values))
    return out


def merge_states(per_rank: list[dict[str, list[tuple[int, int, dict[str, torch.Tensor]]]]],
                 numels: dict[str, int]) -> dict[str, dict[str, torch.Tensor]]:
    """Whole flattened tensors per parameter and key from every rank's ``held_states``.

    Every element of every parameter must be covered (a range held twice must agree); raises
    AssertionError otherwise.
    """
    out: dict[str, dict[str, torch.Tensor]] = {}
    seen: dict[str, torch.Tensor] = {}
    for held in per_rank:
        for name, pieces in held.items():
            for start, end, values in pieces:
                mine = out.setdefault(name, {})
                covered = seen.setdefault(name, torch.zeros(numels[name], dtype=torch.bool))
                for key, value in values.items():
                    if value.dim() == 0:
                        assert key not in mine or torch.equal(mine[key], value), (name, key)
                        mine[key] = value
                        continue
                    whole = mine.setdefault(key, torch.full((numels[name],), float("nan")))
                    part = whole[start:end]
                    assert not covered[start:end].any() or torch.equal(part, value), (name, key, start, end)
                    part.copy_(value)
                covered[start:end] = True
    for name, covered in seen.items():
        assert bool(covered.all()), f"{name}: elements {(~covered).nonzero().flatten()[:5].tolist()} held by no rank"
    return out
