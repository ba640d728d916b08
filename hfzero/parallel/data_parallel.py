"""``hfzero.prepare``, the public entry point: which groups ZeRO runs over, then the engine.

ZeRO data parallelism runs over the world, over a group the caller passes (a pipeline stage's dp ranks, a tensor- or
expert-parallel mesh's dp group), or over HSDP's dp_replicate x dp_shard mesh, which ``config.shard_size`` asks for
and this module builds (mesh.py). The tensor-, expert- and sequence-parallel arguments are checked against the
config here, where the wrappers that build them are known, and the engine (runtime/prepare.py) gets the resolved
``EngineGroups``: it never builds a mesh.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from hfzero.config import ConfigError, ZeroConfig
from hfzero.logging import get_logger
from hfzero.parallel.mesh import build_shard_mesh, check_shard_size
from hfzero.runtime.groups import EngineGroups
from hfzero.runtime.optimizer import ZeroOptimizer
from hfzero.runtime.prepare import check_arguments, prepare_engine
from hfzero.runtime.stage3.weights import WeightSource

logger = get_logger(__name__)


def prepare(model: nn.Module, optimizer: torch.optim.Optimizer, config: ZeroConfig | None = None,
            process_group: dist.ProcessGroup | None = None, *, units: Sequence[str] | None = None,
            verify_gather_order: bool = True, weights: WeightSource | None = None,
            tp_group: dist.ProcessGroup | None = None, ep_group: dist.ProcessGroup | None = None,
            replicate_group: dist.ProcessGroup | None = None,
            average_over: int | None = None) -> tuple[nn.Module, ZeroOptimizer]:
    """Apply ZeRO to ``model`` and ``optimizer`` over ``process_group`` (default: the world group).

    The model keeps its class; its trainable parameters become views into one flat buffer (cast to
    ``config.dtype``) and its ``forward``/``generate`` work unchanged. The returned optimizer replaces
    ``optimizer`` (which must not be used afterwards). Every rank must call this with the same
    model, optimizer and config; a mismatch is reported, not hung on.

    Stage 3: ``units`` names the modules gathered as one unit (default: the decoder blocks, see
    [Note: stage-3 units]); ``verify_gather_order`` checks before every gather that all ranks gather
    the same unit (a tiny extra collective), raising GatherOrderError instead of hanging. At stages 0-2
    ``units`` only keeps each named module's parameters in buckets of their own (the pipeline driver
    uses it so a stage's backward reduces that stage's buckets only: [Note: active buckets] in reducer.py).
    ``weights`` (a stage-3 WeightSource) fills each rank's shard directly, for a model whose trainable
    parameters are on the meta device (see loading/construct.py, ``from_pretrained_sharded``).
    ``tp_group``: the tensor-parallel group of a dp x tp mesh (``process_group`` is then its dp group);
    build both with ``hfzero.parallel.tensor.prepare_tensor_parallel`` rather than by hand.
    ``ep_group``: the expert-parallel group of an edp x ep mesh (``process_group`` is then its
    expert-data-parallel group): the parameters that are DTensor shards (the experts) are sharded and reduced
    over ``process_group``, the others (dense) over the whole world, as are the step checks (See [Note: bucket
    partitions] in layout.py); build both with ``hfzero.parallel.expert.prepare_expert_parallel``.
    ``average_over``: how many data-parallel ranks' gradient sums the step averages (default: the group's
    size; with ``ep_group``, the world size; sequence
    parallelism passes world / sp_size, as an SP group's ranks train on the same samples: build it with
    ``hfzero.parallel.sequence.prepare_sequence_parallel``); see [Note: average_over] in engine.py and
    [Note: sequence-parallel gradients].
    ``config.shard_size`` (HSDP / MiCS) shards over groups of that many ranks of the world and replicates
    across them: prepare builds the dp_replicate x dp_shard mesh itself (``hfzero.parallel.mesh.
    build_shard_mesh``); a caller with a mesh of its own passes its shard group as ``process_group`` and
    ``replicate_group`` (see [Note: hierarchical sharding] in runtime/engine.py).

    A transformers model's activation checkpointing (enabled before or after this call) runs through
    hfzero's checkpoint function, which measures the checkpoints and applies ``partition_activations``,
    ``cpu_checkpointing`` and ``contiguous_checkpoints`` (see runtime/activations/checkpoint.py).
    ``config.mlp_tiles`` > 1 tiles every decoder layer's MLP over the sequence (runtime/activations/tiled_mlp.py).
    """
    config = check_arguments(model, optimizer, config, process_group, units, weights)
    tp_size = dist.get_world_size(tp_group) if tp_group is not None else 1
    if config.tp_size != tp_size:
        raise ConfigError(f"hfzero.prepare: config.tp_size={config.tp_size} but the tensor-parallel group has {tp_size} "
                          "rank(s); build the dp x tp mesh and the TP model with "
                          "hfzero.parallel.tensor.prepare_tensor_parallel(model, optimizer, config)")
    ep_size = dist.get_world_size(ep_group) if ep_group is not None else 1
    if config.ep_size != ep_size:
        raise ConfigError(f"hfzero.prepare: config.ep_size={config.ep_size} but the expert-parallel group has "
                          f"{ep_size} rank(s); build the edp x ep mesh and the expert-parallel model with "
                          "hfzero.parallel.expert.prepare_expert_parallel(model, optimizer, config)")
    _check_sequence_parallel(model, config, process_group, average_over)
    shard, replicate = _shard_groups(config, process_group, replicate_group, tp_size)
    expert = None
    if ep_size > 1:  # the engine's group is the world (dense); the experts' is the edp group given
        expert, shard = shard, None
    groups = EngineGroups(shard=shard, replicate=replicate, expert=expert, tensor=tp_group, average_over=average_over)
    return prepare_engine(model, optimizer, config, groups, units=units, verify_gather_order=verify_gather_order,
                          weights=weights)


def _check_sequence_parallel(model: nn.Module, config: ZeroConfig, group: dist.ProcessGroup | None,
                              average_over: int | None) -> None:
    """sp_size > 1: ZeRO over the whole world, gradients averaged over its world / sp_size dp replicas."""
    world = dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1
    if average_over is not None and not _is_positive_int(average_over):
        raise ConfigError(f"hfzero.prepare: average_over={average_over!r} must be a positive integer")
    tiles = getattr(model, "hfzero_loss_tiles", 1)  # set by hfzero.parallel.sequence.enable_tiled_loss
    if config.loss_tiles != tiles:
        raise ConfigError(f"hfzero.prepare: config.loss_tiles={config.loss_tiles} but the model's loss is "
                          f"{'tiled in ' + str(tiles) if tiles > 1 else 'not tiled'}; call "
                          "hfzero.parallel.sequence.enable_tiled_loss(model, config.loss_tiles) first (ZeroTrainer, "
                          "ZeroAccelerator and prepare_sequence_parallel do it)")
    if config.sp_size > 1 and (group is not None or average_over != world // config.sp_size):
        raise ConfigError(f"hfzero.prepare: config.sp_size={config.sp_size} needs the model switched to sequence-"
                          "parallel attention and ZeRO over the whole world averaging over the dp replicas; use "
                          "hfzero.parallel.sequence.prepare_sequence_parallel(model, optimizer, config)")


def _is_positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _shard_groups(config: ZeroConfig, process_group: dist.ProcessGroup | None,
                  replicate_group: dist.ProcessGroup | None,
                  tp_size: int) -> tuple[dist.ProcessGroup | None, dist.ProcessGroup | None]:
    """The shard group ZeRO runs over and the replicate group (None: flat), checked before any collective.
    With ``config.shard_size`` over the whole world, builds the dp_replicate x dp_shard mesh (a collective
    every rank reaches at the same point: here)."""
    if replicate_group is not None:
        shard = dist.get_world_size(process_group)
        if shard < 2 and dist.get_world_size(replicate_group) > 1:
            raise ConfigError("hfzero.prepare: the shard group passed as process_group has one rank, so it shards "
                              "nothing and the replicas' step checks would not run; pass a shard group of at least "
                              "2 ranks, or use stage 0 (plain data parallelism) over the whole world")
        if config.shard_size not in (0, shard):
            raise ConfigError(f"hfzero.prepare: config.shard_size={config.shard_size} but the shard group passed as "
                              f"process_group has {shard} rank(s)")
        return process_group, replicate_group
    if not config.shard_size or not (dist.is_available() and dist.is_initialized()):
        if config.shard_size > 1:
            raise ConfigError(f"hfzero.prepare: shard_size={config.shard_size} needs torch.distributed initialized "
                              f"with a world that it divides; launch with `hfzero run` or torchrun")
        return process_group, None
    dp_size = dist.get_world_size(process_group)
    check_shard_size(dp_size, config.shard_size)
    if config.shard_size == dp_size:
        return process_group, None  # one shard group: flat ZeRO
    whole_world = process_group is None or dist.get_world_size(process_group) == dist.get_world_size()
    if tp_size > 1 or not whole_world:
        raise ConfigError("hfzero.prepare: shard_size (HSDP) over a sub-group (a tensor-parallel mesh's dp group, or a "
                          "group of your own) needs that group's shard and replicate groups: use "
                          "hfzero.parallel.tensor.prepare_tensor_parallel (tensor parallelism) or hfzero.pipeline, "
                          "which build them, or build the mesh yourself and pass process_group=<shard group>, "
                          "replicate_group=<replicate group>")
    mesh = build_shard_mesh(config.shard_size)
    logger.info("HSDP: model states sharded over %d rank(s), replicated %d times (dp_replicate x dp_shard mesh)",
                mesh.shard_size, mesh.replicate_size)
    return mesh.shard_group, mesh.replicate_group
