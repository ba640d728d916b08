"""Pieces shared by save and load: the model's tensor inventory and the ranks' agreement on errors."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import torch
from torch import nn

from hfzero.checkpoint.errors import CheckpointError
from hfzero.comm import Communicator
from hfzero.runtime.engine import ZeroEngine
from hfzero.runtime.prepare import get_engine


def engine_of(model: nn.Module, optimizer: torch.optim.Optimizer) -> ZeroEngine:
    """The engine of a prepared model, checking that ``optimizer`` is the one prepare returned with it."""
    engine = get_engine(model)
    if getattr(optimizer, "engine", None) is not engine:
        raise CheckpointError("the optimizer is not the ZeroOptimizer that hfzero.prepare returned with this model; "
                              "pass the (model, optimizer) pair prepare returned")
    if engine.optimizer is None:
        raise CheckpointError("the engine has no inner optimizer; build the model and optimizer with hfzero.prepare")
    return engine


@dataclasses.dataclass
class Inventory:
    """Every tensor of the model by state-dict name, split the way a checkpoint stores them.

    Attributes:
        trainable: names of parameters in the engine's layout (saved as fp32 slices by every rank).
        frozen: other parameters and persistent buffers (saved whole by rank 0): name -> (tensor, kind).
        aliases: tied names -> the canonical (first registered) name of the same tensor.
        order: canonical names in ``state_dict`` order (the order an HF export writes).
        tied_targets: names the model re-ties on load (``_tied_weights_keys``): an export omits them.
    """

    trainable: dict[str, nn.Parameter]
    frozen: dict[str, tuple[torch.Tensor, str]]
    aliases: dict[str, str]
    order: list[str]
    tied_targets: list[str]


def inventory(model: nn.Module, engine: ZeroEngine) -> Inventory:
    """Walk the modules in ``state_dict`` order (no tensor is copied)."""
    in_layout = {id(slot.param): slot.name for slot in engine.layout.slots.values()}
    first: dict[int, str] = {}
    inv = Inventory({}, {}, {}, [], [])
    for prefix, module in model.named_modules(remove_duplicate=False):
        stem = f"{prefix}." if prefix else ""
        tensors: list[tuple[str, torch.Tensor, str]] = [
            (stem + n, p, "parameter") for n, p in module._parameters.items() if p is not None]
        tensors += [(stem + n, b, "buffer") for n, b in module._buffers.items()
                    if b is not None and n not in module._non_persistent_buffers_set]
        for name, tensor, kind in tensors:
            if id(tensor) in first:
                if first[id(tensor)] != name:
                    inv.aliases[name] = first[id(tensor)]
                continue
            first[id(tensor)] = name
            inv.order.append(name)
            if kind == "parameter" and id(tensor) in in_layout:
                inv.trainable[in_layout[id(tensor)]] = tensor
            else:
                inv.frozen[name] = (tensor, kind)
    tied = getattr(model, "all_tied_weights_keys", None) or getattr(model, "_tied_weights_keys", None) or []
    inv.tied_targets = sorted(str(k) for k in tied)
    return inv


def agree(comm: Communicator, error: str | None, what: str) -> None:
    """Every rank reports ``error`` (None when fine); if any rank failed, every rank raises.

    Used wherever a rank could fail alone: raising on one rank only would leave the others waiting
    in the next collective forever. Also a barrier.
    """
    payload = json.dumps(error).encode()
    errors = [json.loads(b) for b in comm.all_gather_bytes(payload)]
    by_message: dict[str, list[int]] = {}
    for rank, e in enumerate(errors):
        if e:
            by_message.setdefault(e, []).append(rank)
    if not by_message:
        return
    if comm.world_size == 1:
        raise CheckpointError(f"{what}: {errors[0]}")
    detail = "; ".join(f"rank(s) {ranks}: {e}" for e, ranks in by_message.items())
    raise CheckpointError(f"{what}: {detail}")


def gather_json(comm: Communicator, obj: Any) -> list[Any]:
    """Every rank's JSON-able ``obj``, in rank order (small metadata only)."""
    return [json.loads(b) for b in comm.all_gather_bytes(json.dumps(obj).encode())]
