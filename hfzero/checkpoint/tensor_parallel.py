"""Checkpoints under tensor parallelism: a TP rank's local-shard ranges in whole-parameter coordinates.

[Note: tensor-parallel checkpoints]
A checkpoint of a dp x tp model is one checkpoint of the whole model in the format of docs/checkpoints.md:
- every rank of the world writes ``rank<global>-of-<world>``; its engine's ranges are ranges of its *local*
  TP shard (flattened), which this module maps to ranges of the whole flattened parameter;
- a shard along dim 0 (colwise weights) is one contiguous run of the whole parameter; a shard along a
  later dim d (rowwise weights, d = 1) is one run per index of the dims before d. The rank file still
  holds one 1-D tensor per parameter (its local range, as without TP); each manifest piece says which
  whole-parameter range ``[start, end)`` it covers and ``at``, where that run starts in the file's tensor
  (absent = 0, so checkpoints without TP read as before);
- parameters replicated over TP (norms, embeddings, ``lm_head``) are written by TP rank 0's dp ranks only;
  frozen tensors and buffers by global rank 0;
- the manifest adds ``tensor_parallel`` (tp and dp sizes), informational only: loading maps the pieces
  to whatever layout reads them, so tp=2 loads at tp=1 (and back) at any dp size and ZeRO stage, and
  ``hfzero consolidate`` writes whole tensors.
Shards must split their dimension evenly (``check_heads`` ensures it for attention; a plan whose sizes do
not divide is refused when saving or loading).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Shard

from hfzero.checkpoint.errors import CheckpointError
from hfzero.runtime.tensors import is_replicated_over_tp

Run = tuple[int, int, int]
"""(start, end, at): elements [start, end) of the whole flattened parameter, at offset ``at`` of a local range."""


def shard_dim(param: torch.Tensor) -> tuple[int, int, int] | None:
    """(dim, tp size, tp rank) of a DTensor sharded over a 1-D TP mesh; None for anything replicated."""
    if not isinstance(param, DTensor) or is_replicated_over_tp(param):
        return None
    placements = param.placements
    if len(placements) != 1 or not isinstance(placements[0], Shard):
        raise CheckpointError(f"hfzero checkpoints support DTensor parameters sharded on one 1-D TP mesh "
                              f"(Shard(d)); got placements {placements}")
    mesh = param.device_mesh
    dim, size = placements[0].dim, mesh.size()
    if param.shape[dim] % size:
        raise CheckpointError(f"a TP shard of shape {tuple(param.shape)} along dim {dim} over {size} ranks is "
                              "uneven; hfzero checkpoints need sizes the TP degree divides")
    return dim, size, mesh.get_coordinate()[0]


def whole_shape(param: torch.Tensor, local_shape: torch.Size) -> torch.Size:
    """The parameter's whole shape: a DTensor's global shape, else the engine's (local) one."""
    return param.shape if isinstance(param, DTensor) else local_shape


def whole_runs(param: torch.Tensor, start: int, end: int) -> list[Run]:
    """Elements [start, end) of ``param``'s flattened local tensor as runs of the whole flattened parameter.

    Local shape L, whole shape F, shard dim d, this rank's offset o = rank * L[d]: local element i
    with ``block = L[d] * inner`` (inner = prod(F[d+1:])) sits at whole element
    ``(i // block) * F[d] * inner + o * inner + i % block``; runs break at multiples of ``block``.
    """
    sharded = shard_dim(param)
    if sharded is None:
        return [(start, end, 0)]
    dim, size, rank = sharded
    whole = param.shape
    inner = math.prod(whole[dim + 1:])
    local_d = whole[dim] // size
    block = local_d * inner
    runs = []
    i = start
    while i < end:
        stop = min(end, (i // block + 1) * block)
        first = (i // block) * whole[dim] * inner + rank * local_d * inner + i % block
        runs.append((first, first + stop - i, i - start))
        i = stop
    return runs


def tp_info(model: Any) -> tuple[int, int, int] | None:
    """(tp size, tp rank, dp size) when ``model``'s engine runs over the dp group of a dp x tp mesh (or, HSDP x TP,
    over a shard group of it: dp is then the shard group times its replicas), else None."""
    from hfzero.runtime.engine import get_engine

    engine = get_engine(model)
    group = engine.norm_group
    if group is None or group.world_size == 1:
        return None
    replicas = engine.replicate.world_size if engine.replicate is not None else 1
    return group.world_size, group.rank, engine.world_size * replicas


def replicated_names(engine: Any) -> set[str]:
    """Engine names of the trainable parameters every TP rank holds whole (written by TP rank 0 only)."""
    return {slot.name for slot in engine.layout.slots.values() if is_replicated_over_tp(slot.param)}


def refuse_sharded_frozen(model: Any) -> None:
    """Frozen DTensor parameters are not saved by hfzero checkpoints yet: say so instead of writing shards."""
    sharded = [n for n, p in model.named_parameters() if not p.requires_grad and shard_dim(p) is not None]
    if sharded:
        raise CheckpointError(f"frozen parameters sharded over tensor parallelism ({sharded[:3]}) cannot be "
                              "checkpointed yet; keep frozen parameters out of the TP plan")
