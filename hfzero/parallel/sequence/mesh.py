"""The dp x sp mesh of sequence parallelism, and which process group is which.

Rank layout: ``rank = dp_rank * sp_size + sp_rank`` (the ranks of one SP group are neighbours, as on a
node: the all-to-all of every attention layer stays on the fastest links).
"""

from __future__ import annotations

import dataclasses

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from hfzero.parallel.mesh import check_divides, split_world_mesh


@dataclasses.dataclass(frozen=True)
class SequenceMesh:
    """The calling rank's place in a dp x sp mesh.

    Attributes:
        mesh: the DeviceMesh with dimensions ("dp", "sp").
        dp_size: data-parallel replicas (groups that see different samples); sp_size: ranks sharing a sequence.
        dp_rank, sp_rank: this rank's coordinates (sp_rank: which chunk of each sequence it holds).
        sp_group: the ranks of this rank's SP group (the attention all-to-all runs here).
    """

    mesh: DeviceMesh
    dp_size: int
    sp_size: int
    dp_rank: int
    sp_rank: int
    sp_group: dist.ProcessGroup


def check_sp_size(world_size: int, sp_size: int) -> int:
    """The dp size for ``sp_size`` over ``world_size`` ranks; a clear error when it does not divide."""
    return check_divides(world_size, "sp_size", sp_size, "data-parallel")


def build_sp_mesh(sp_size: int) -> SequenceMesh:
    """The dp x sp mesh over the whole world (collective: every rank calls it, in the same order)."""
    mesh, dp_size = split_world_mesh("sequence parallelism", "sp_size", sp_size, ("dp", "sp"))
    dp_rank, sp_rank = mesh.get_coordinate()
    return SequenceMesh(mesh, dp_size, sp_size, dp_rank, sp_rank, mesh.get_group("sp"))
