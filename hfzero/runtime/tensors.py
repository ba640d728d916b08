"""Walking nested module outputs (tensors inside tuples, lists and dicts such as ModelOutput), the local
tensor of a DTensor parameter (tensor parallelism), and scaling tensors by a coefficient wherever it lives."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch.distributed.tensor import DTensor


def iter_tensors(value: Any) -> Iterator[torch.Tensor]:
    """Every tensor in ``value``: itself, or inside (nested) tuples, lists and dicts, in order."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from iter_tensors(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from iter_tensors(v)


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds: a DTensor's local shard (tensor parallelism), else the tensor itself.

    The engine flattens, shards and updates local tensors only; see [Note: tensor-parallel parameters]
    in parallel/tensor.py. Under no_grad this is the DTensor's own local tensor object, so
    setting its ``.data`` re-points the DTensor's storage.
    """
    if isinstance(tensor, DTensor):
        return tensor._local_tensor
    return tensor


def is_replicated_over_tp(param: torch.Tensor) -> bool:
    """True when every rank of the tensor-parallel group holds the whole parameter (a plain tensor, or
    a DTensor replicated on every mesh dimension): its gradient is counted once in the global norm."""
    if isinstance(param, DTensor):
        return all(p.is_replicate() for p in param.placements)
    return True


def scale_(tensors: Iterable[torch.Tensor], coef: torch.Tensor) -> None:
    """Multiply each of ``tensors`` in place by the 0-dim ``coef`` (a clip coefficient) with no copy per tensor.

    A coefficient on the CPU (the scratch device under gloo: See [Note: collective device] in hfzero/devices.py)
    scales tensors on any device as a kernel argument: no copy, no host synchronization. One on an accelerator
    is moved once to the tensors' device when they are elsewhere (the host, with the optimizer offloaded).
    """
    for tensor in tensors:
        if coef.device.type != "cpu" and coef.device != tensor.device:
            coef = coef.to(tensor.device)
        tensor.mul_(coef.to(dtype=tensor.dtype))
