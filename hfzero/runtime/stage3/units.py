"""Which modules are stage-3 gathering units, and which unit owns each parameter.

[Note: stage-3 units]
A unit is a module whose parameters are gathered together before its forward (and backward) and
released after. By default the units are the children of the model's largest ``nn.ModuleList`` (the
decoder blocks of a Hugging Face model: ``transformer.h``, ``model.layers``) and of any other block
stack of comparable size (an encoder-decoder's encoder blocks), plus the root unit: the
model itself, owning every parameter outside those blocks (embeddings, final norm, lm_head). A
parameter shared by two units (tied weights) belongs to the root unit, which stays gathered for the
whole forward and the whole backward, so every use of it sees the full tensor. Units must not nest.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from torch import nn

from hfzero.config import ConfigError
from hfzero.runtime.tensors import local_tensor

ROOT = ""
"""The root unit's name (the model itself)."""


@dataclasses.dataclass(eq=False)
class UnitSpec:
    """Attributes:
    index: position in registration order (the root is 0).
    name: the module's qualified name ("" for the root).
    module: the module whose forward hooks gather and release the unit.
    params: trainable parameters the unit owns (persistent ones included).
    """

    index: int
    name: str
    module: nn.Module
    params: list[nn.Parameter]


def _param_count(module: nn.Module) -> int:
    return sum(local_tensor(p).numel() for p in module.parameters())


BLOCK_LIST_FRACTION = 4
"""A ModuleList is a stack of blocks when it holds at least 1/this of the largest list's parameters."""


def default_unit_names(model: nn.Module) -> list[str]:
    """Children of the block stacks: the ModuleList holding the most parameters (decoder blocks), and
    every other ModuleList outside it holding at least 1/BLOCK_LIST_FRACTION as many (an encoder-
    decoder's encoder blocks); [] if there is none."""
    lists = sorted(((_param_count(m), name) for name, m in model.named_modules()
                    if isinstance(m, nn.ModuleList) and len(m) > 0), key=lambda t: -t[0])
    if not lists or lists[0][0] == 0:
        return []
    chosen: list[str] = []
    for count, name in lists:
        nested = any(name.startswith(c + ".") or c.startswith(name + ".") for c in chosen)
        if count * BLOCK_LIST_FRACTION >= lists[0][0] and not nested:
            chosen.append(name)
    order = {name: i for i, (name, _) in enumerate(model.named_modules())}
    return [f"{name}.{child}" for name in sorted(chosen, key=order.__getitem__)
            for child, _ in model.get_submodule(name).named_children()]


def resolve_units(model: nn.Module, names: Sequence[str] | None, trainable: set[nn.Parameter]) -> list[UnitSpec]:
    """The root unit followed by one unit per module name; see [Note: stage-3 units]."""
    names = default_unit_names(model) if names is None else list(names)
    modules = dict(model.named_modules())
    unknown = [n for n in names if n not in modules or n == ROOT]
    if unknown:
        raise ConfigError(f"hfzero stage 3: units {unknown} are not submodules of the model (the root is always "
                          "a unit); pass qualified names from model.named_modules(), e.g. 'model.layers.0'")
    if len(set(names)) != len(names):
        raise ConfigError(f"hfzero stage 3: units {names} name a module twice")
    for a in names:
        for b in names:
            if a != b and b.startswith(a + "."):
                raise ConfigError(f"hfzero stage 3: unit {b!r} is nested inside unit {a!r}; units must not nest")
    owner: dict[nn.Parameter, int] = {}
    for index, name in enumerate(names, start=1):
        for p in modules[name].parameters():
            if p in trainable:
                owner[p] = 0 if p in owner else index  # shared by two units: the root owns it
    units = [UnitSpec(0, ROOT, model, [])] + [UnitSpec(i, n, modules[n], []) for i, n in enumerate(names, start=1)]
    for p in model.parameters():
        if p in trainable:
            units[owner.get(p, 0)].params.append(p)
    # A unit's parameter also registered outside every unit (tied to a root module) is the root's.
    root_side = {p for mname, m in modules.items()
                 if not any(mname == n or mname.startswith(n + ".") for n in names)
                 for p in m.parameters(recurse=False)}
    for unit in units[1:]:
        tied = [p for p in unit.params if p in root_side]
        if tied:
            unit.params = [p for p in unit.params if p not in root_side]
            units[0].params.extend(tied)
    return units
