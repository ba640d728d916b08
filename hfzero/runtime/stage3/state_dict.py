"""Full (unsharded) state dicts of a stage-3 model, gathered one unit at a time.

[Note: stage-3 state_dict]
At stage 3, between uses, a partitioned parameter is a 0-element tensor of its dtype (see
[Note: stage-3 release]), so ``model.state_dict()`` would return empty tensors for it: saving that
would write an empty model, and the engine refuses it with an error that points here. ``full_state_dict(model)`` gathers each unit in turn (a collective:
every rank must call it), copies its parameters to the CPU and releases it again, so at most one
unit's full buffer is resident at a time beyond the result. Under tensor parallelism a parameter
sharded over TP (a DTensor) is made whole with ``full_tensor()`` (a collective over the TP group), one
parameter at a time, so the result holds full tensors whatever the TP degree.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor


def full_state_dict(model: nn.Module, *, rank0_only: bool = True) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` with every parameter whole, as CPU tensors.

    Collective over the model's data-parallel group (and its tensor-parallel group). With
    ``rank0_only`` the other ranks take part in the gathers but return ``{}``, so only data-parallel
    rank 0 (every TP rank of it) holds the (CPU) copy of the model. Under expert parallelism the engine's
    group is the world: world rank 0 keeps the copy, the other ranks of its EP group (edp rank 0) make the
    experts whole with it (``full_tensor()`` over EP) and return ``{}``.
    """
    from hfzero.runtime.engine import get_engine
    from hfzero.runtime.stage3.engine import Stage3Engine
    from hfzero.runtime.stage3.unit import UnitState

    engine = get_engine(model)
    keep = not rank0_only or engine.rank == 0
    expert_comm = getattr(engine, "expert_comm", None)
    collect = keep or (expert_comm is not None and expert_comm.rank == 0)  # rank 0's EP group: full_tensor()
    if not isinstance(engine, Stage3Engine):
        copies = _copies(model.state_dict(keep_vars=True), {}) if collect else {}
        return copies if keep else {}
    gathered: dict[nn.Parameter, torch.Tensor] = {}
    for unit in engine.units:
        was_sharded = unit.state is UnitState.SHARDED
        engine.scheduler.gather_now(unit)
        if collect:
            for p in unit.params:
                gathered[p] = whole_cpu(p)
        if was_sharded:
            unit.release()
    if not collect:
        return {}
    engine.allow_partitioned_state_dict = True  # the empty entries are replaced by the gathered tensors below
    try:
        entries = model.state_dict(keep_vars=True)
    finally:
        engine.allow_partitioned_state_dict = False
    copies = _copies(entries, gathered)  # whole_cpu of any DTensor not in a unit: collective over its mesh too
    return copies if keep else {}


def _copies(entries: dict[str, torch.Tensor], gathered: dict[nn.Parameter, torch.Tensor]) -> dict[str, torch.Tensor]:
    """CPU copies of ``entries`` (``state_dict(keep_vars=True)``), the gathered one for a partitioned
    parameter. A tensor under several names (tied weights) is copied once and shared by its names, so
    ``save_pretrained`` sees the tie and writes it once, as it does for the unprepared model."""
    copies: dict[int, torch.Tensor] = {}
    out: dict[str, torch.Tensor] = {}
    for key, value in entries.items():
        tensor = gathered.get(value) if isinstance(value, nn.Parameter) else None
        if tensor is None:
            tensor = copies.get(id(value))
            if tensor is None:
                tensor = copies[id(value)] = whole_cpu(value)
        out[key] = tensor
    return out


def whole_cpu(tensor: torch.Tensor) -> torch.Tensor:
    """A CPU copy of ``tensor``, made whole first when it is a DTensor sharded over tensor parallelism
    (``full_tensor()``: a collective over its mesh; every TP rank must call it in the same order)."""
    tensor = tensor.detach()
    if isinstance(tensor, DTensor):
        tensor = tensor.full_tensor()
    return tensor.to("cpu", copy=True)
