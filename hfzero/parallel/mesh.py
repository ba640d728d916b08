"""One 2-D DeviceMesh (pp x dp) from sizes, and which process group is which.

Rank layout (torchtitan's): ``rank = pp_rank * dp_size + dp_rank``, so the ranks of one pipeline
stage (a data-parallel group) are neighbours and the ranks of one pipeline (one data-parallel
replica) are ``dp_size`` apart. HSDP (``ZeroConfig.shard_size``) cuts a data-parallel group into shard
groups of consecutive dp ranks: alone (dp_replicate x dp_shard), inside each pipeline stage
(pp x dp_replicate x dp_shard) or inside each tensor-parallel rank's dp group (dp_replicate x dp_shard x tp).
"""

from __future__ import annotations

import dataclasses

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from hfzero.comm.collectives import _default_device
from hfzero.config import ConfigError


@dataclasses.dataclass(frozen=True)
class PipelineMesh:
    """The calling rank's place in a pp x dp mesh.

    Attributes:
        mesh: the DeviceMesh with dimensions ("pp", "dp").
        pp_size: pipeline stages (ranks per pipeline).
        dp_size: data-parallel replicas (ranks per stage).
        pp_rank: this rank's stage (its coordinate along "pp").
        dp_rank: this rank's replica (its coordinate along "dp").
        pp_group: the ranks of this rank's pipeline (same dp_rank): activations and the loss travel here.
        dp_group: the ranks of this rank's stage (same pp_rank): ZeRO runs here.
    """

    mesh: DeviceMesh
    pp_size: int
    dp_size: int
    pp_rank: int
    dp_rank: int
    pp_group: dist.ProcessGroup
    dp_group: dist.ProcessGroup

    def global_rank(self, pp_rank: int, dp_rank: int) -> int:
        """The world rank at mesh coordinates (pp_rank, dp_rank)."""
        return int(self.mesh.mesh[pp_rank, dp_rank])


def check_sizes(world_size: int, pp_size: int) -> int:
    """The dp size for ``pp_size`` stages over ``world_size`` ranks; a clear error when it does not divide."""
    if not isinstance(pp_size, int) or isinstance(pp_size, bool) or pp_size < 1:
        raise ConfigError(f"hfzero pipeline: pp_size={pp_size!r} must be a positive integer")
    if world_size % pp_size:
        raise ConfigError(f"hfzero pipeline: pp_size={pp_size} does not divide the world size {world_size}; "
                          f"use a divisor of {world_size} (the data-parallel size is world / pp_size)")
    return world_size // pp_size


def initialized_world_size(what: str) -> int:
    """The world size; a clear error naming the feature ``what`` when torch.distributed is not initialized."""
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(f"hfzero {what}: torch.distributed is not initialized; launch with `hfzero run` or "
                           "torchrun and call torch.distributed.init_process_group first")
    return dist.get_world_size()


def world_mesh(sizes: tuple[int, ...], names: tuple[str, ...]) -> DeviceMesh:
    """A device mesh of ``sizes`` (dims ``names``) over the whole world, on the backend's device type
    (collective: every rank calls it, in the same order)."""
    device_type = _default_device().type  # See [Note: collective device]
    return init_device_mesh(device_type, sizes, mesh_dim_names=names)


def check_divides(world_size: int, field: str, size: int, rest: str) -> int:
    """``world_size // size``: the size of the ``rest`` dimension when ``field=size`` ranks split the world;
    a clear ConfigError when ``size`` does not divide ``world_size``."""
    if world_size % size:
        raise ConfigError(f"hfzero: {field}={size} does not divide the world size {world_size}; use a divisor "
                          f"of {world_size} (the {rest} size is world / {field})")
    return world_size // size


def split_world_mesh(feature: str, field: str, size: int, names: tuple[str, ...],
                     inner: tuple[int, ...] = ()) -> tuple[DeviceMesh, int]:
    """A (world / size) x size [x inner] mesh over the whole world, dims ``names`` (the outer one first), and
    the outer size (collective: every rank calls it, in the same order). ``feature`` names what needs it in the
    error raised when torch.distributed is not initialized; ``field`` is the option ``size`` comes from."""
    outer = check_divides(initialized_world_size(feature), field, size, names[0])
    return world_mesh((outer, size, *inner), names), outer


def build_mesh(pp_size: int) -> PipelineMesh:
    """The pp x dp mesh over the whole world (collective: every rank calls it, in the same order)."""
    dp_size = check_sizes(initialized_world_size("pipeline"), pp_size)
    mesh = world_mesh((pp_size, dp_size), ("pp", "dp"))
    coords = mesh.get_coordinate()
    return PipelineMesh(mesh, pp_size, dp_size, coords[0], coords[1], mesh.get_group("pp"), mesh.get_group("dp"))


@dataclasses.dataclass(frozen=True)
class ShardMesh:
    """The calling rank's place in a dp_replicate x dp_shard mesh (HSDP / MiCS; ``ZeroConfig.shard_size``).

    Rank layout: ``rank = replicate_rank * shard_size + shard_rank``, so a shard group is ``shard_size``
    consecutive ranks (inside one node when ``shard_size`` divides the ranks per node) and a replicate group
    holds the ranks with the same shard index, ``shard_size`` apart (one per node when ``shard_size`` equals
    the ranks per node).

    Attributes:
        mesh: the DeviceMesh with dimensions ("dp_replicate", "dp_shard").
        shard_size: ranks per shard group (G): model states are sharded over them.
        replicate_size: shard groups (dp world / G): each holds a full copy of the model states.
        shard_group: this rank's shard group: reduce-scatters, stage-3 gathers, the post-step all-gather.
        replicate_group: the ranks holding the same shard: the per-step all-reduce of the gradient shard.
    """

    mesh: DeviceMesh
    shard_size: int
    replicate_size: int
    shard_group: dist.ProcessGroup
    replicate_group: dist.ProcessGroup


def check_shard_size(dp_size: int, shard_size: int) -> int:
    """The number of replicas for ``shard_size`` over ``dp_size`` data-parallel ranks; a clear ConfigError when
    it does not divide."""
    if shard_size > dp_size or dp_size % shard_size:
        divisors = [d for d in range(2, dp_size + 1) if dp_size % d == 0]
        raise ConfigError(f"hfzero: ZeroConfig.shard_size={shard_size} (--zero_shard_size) does not divide the "
                          f"data-parallel world of {dp_size} rank(s); use one of {divisors} (usually the ranks "
                          "per node), or 0 to shard over the whole data-parallel world")
    return dp_size // shard_size


def build_shard_mesh(shard_size: int) -> ShardMesh:
    """The dp_replicate x dp_shard mesh over the whole world (collective: every rank calls it, in the same
    order). ``shard_size`` must divide the world (``check_shard_size``)."""
    replicate = check_shard_size(initialized_world_size("shard_size"), shard_size)
    mesh = world_mesh((replicate, shard_size), ("dp_replicate", "dp_shard"))
    return ShardMesh(mesh, shard_size, replicate, mesh.get_group("dp_shard"), mesh.get_group("dp_replicate"))


def build_pipeline_shard_groups(pipe_mesh: PipelineMesh, shard_size: int) -> tuple[dist.ProcessGroup,
                                                                                    dist.ProcessGroup]:
    """HSDP inside each pipeline stage: (shard group, replicate group) of a pp x dp_replicate x dp_shard mesh
    over the whole world (collective: every rank calls it, in the same order). ``rank = pp_rank * dp_size +
    replicate_rank * shard_size + shard_rank``, the pp x dp layout with each stage's dp ranks cut into shard
    groups of ``shard_size`` consecutive ranks, so ``pipe_mesh.dp_group`` is the union of this rank's shard
    group and its replicas. ``shard_size`` must divide the dp size and be below it (``check_shard_size``)."""
    replicate = check_shard_size(pipe_mesh.dp_size, shard_size)
    mesh = world_mesh((pipe_mesh.pp_size, replicate, shard_size), ("pp", "dp_replicate", "dp_shard"))
    return mesh.get_group("dp_shard"), mesh.get_group("dp_replicate")


def build_tensor_shard_groups(dp_size: int, tp_size: int, shard_size: int) -> tuple[dist.ProcessGroup,
                                                                                    dist.ProcessGroup]:
    """HSDP under tensor parallelism: (shard group, replicate group) of a dp_replicate x dp_shard x tp mesh over
    the whole world (collective: every rank calls it, in the same order). ``rank = (replicate_rank * shard_size
    + shard_rank) * tp_size + tp_rank``, the dp x tp layout (``rank = dp_rank * tp_size + tp_rank``,
    hfzero/parallel/tensor.py) with the dp ranks of each TP rank cut into shard groups of ``shard_size``
    consecutive dp ranks: a shard group holds ranks ``tp_size`` apart with the same tp_rank, and the dp group of
    that tp_rank is the union of the shard group and its replicas. ``shard_size`` must divide ``dp_size`` and be
    below it (``check_shard_size``)."""
    replicate = check_shard_size(dp_size, shard_size)
    mesh = world_mesh((replicate, shard_size, tp_size), ("dp_replicate", "dp_shard", "tp"))
    return mesh.get_group("dp_shard"), mesh.get_group("dp_replicate")
