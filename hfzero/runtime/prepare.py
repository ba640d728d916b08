"""``hfzero.prepare``: validate the inputs once, then build the engine and the sharded optimizer."""

from __future__ import annotations

import functools
import hashlib
import json
import os
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from hfzero.comm import Communicator
from hfzero.config import STAGE_AUTO, ConfigError, ZeroConfig
from hfzero.devices import collective_device
from hfzero.logging import get_logger
from hfzero.runtime.activations.checkpoint import CheckpointPolicy, enable_checkpointing
from hfzero.runtime.activations.tiled_mlp import enable_tiled_mlp, mlp_tiles_of
from hfzero.runtime.engine import ZeroEngine
from hfzero.runtime.hostmem import configure_host_allocator
from hfzero.runtime.optimizer import ZeroOptimizer
from hfzero.runtime.placement import check_placement
from hfzero.runtime.pending import PendingWeights, find_pending, materialize_whole
from hfzero.runtime.pending import release as release_pending
from hfzero.runtime.stage3 import Stage3Engine
from hfzero.runtime.stage3.weights import WeightSource, materialize_meta_params

logger = get_logger(__name__)

_ENGINE_ATTR = "hfzero_engine"
_prepared_count = 0
"""Models this process prepared (``hfzero run`` reports a script that prepared none; see launch.py)."""


def prepared_count() -> int:
    """How many models ``prepare`` has applied ZeRO to in this process."""
    return _prepared_count


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
    parameters are on the meta device (see stage3/init.py, ``from_pretrained_sharded``).
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
    config = config or ZeroConfig()
    if not isinstance(config, ZeroConfig):
        raise ConfigError(f"hfzero.prepare: config must be a hfzero.ZeroConfig, got {type(config).__name__}")
    if not isinstance(model, nn.Module):
        raise TypeError(f"hfzero.prepare: model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError("hfzero.prepare: optimizer must be a torch.optim.Optimizer built over the model's "
                        f"parameters, got {type(optimizer).__name__}")
    if getattr(model, _ENGINE_ATTR, None) is not None:
        raise ConfigError("hfzero.prepare: this model was already prepared; prepare a model once")
    if config.stage == STAGE_AUTO:
        raise ConfigError('hfzero.prepare: ZeroConfig(stage="auto") must be resolved first: '
                          "config = hfzero.autostage.resolve_auto_stage(config, model, optimizer, world_size=...) "
                          "(the Trainer and ZeroAccelerator do this for you)")
    _check_process_group(process_group)
    if units is not None and (isinstance(units, str) or not all(isinstance(u, str) for u in units)):
        raise ConfigError("hfzero.prepare: units must be a list of module names, e.g. ['model.layers.0']")
    if weights is not None and config.stage != 3:
        raise ConfigError("hfzero.prepare: weights= (sharded construction) applies to ZeroConfig(stage=3) only")
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
    if mlp_tiles_of(model) not in (1, config.mlp_tiles):
        raise ConfigError(f"hfzero.prepare: config.mlp_tiles={config.mlp_tiles} but the model's MLPs are tiled in "
                          f"{mlp_tiles_of(model)}; pass the same mlp_tiles (prepare tiles them itself)")
    process_group, replicate_group = _shard_groups(config, process_group, replicate_group, tp_size)
    expert_group = None
    if ep_size > 1:  # the engine's group is the world (dense); the experts' is the edp group given
        expert_group, process_group = process_group, None
    pending = find_pending(model) if weights is None else None
    if pending is not None:  # See [Note: pending weights] in runtime/pending.py
        weights = _read_pending(model, optimizer, config, process_group, pending)
    groups = _optimizer_groups(model, optimizer)
    # a model with nothing to train (a frozen reference model, stage 3): placed by its frozen parameters
    placed = groups if any(groups) or config.stage != 3 else [[p for p in model.parameters() if not p.requires_grad]]
    device = _single_device(placed) if weights is None else _meta_device(placed, weights.device)
    check_placement(device, process_group)  # before any collective: a clear error, not an NCCL one
    if config.mixed_precision:
        model.to(config.torch_dtype)
    if weights is not None:  # trainable and frozen parameters left on meta get their shard from ``weights``
        frozen = [p for p in model.parameters() if not p.requires_grad]
        materialize_meta_params([p for group in groups for p in group] + frozen, device)
    if device.type == "cpu":
        # glibc's own trim of the heap's top stays unless the growth-triggered trim replaces it.
        by_growth = config.host_trim and config.host_trim_slack > 0
        configure_host_allocator(config.host_mmap_threshold, top_trim=not by_growth)  # See [Note: host allocator]
    comm = Communicator(process_group, config.reduce_scatter_impl, device=device, ranks_per_node=config.ranks_per_node)
    replicate = comm.on_group(replicate_group) if replicate_group is not None else None  # counted with comm's
    _check_ranks_agree(comm, config, model, optimizer, groups)
    groups_kw = {"average_over": average_over}
    if expert_group is not None:  # See [Note: bucket partitions] in layout.py; counted with comm's
        groups_kw["expert_comm"] = comm.on_group(expert_group)
    if replicate is not None:  # the other shard groups too: the whole world passes the same
        _check_ranks_agree(replicate.on_group(replicate.group, share_stats=False), config, model, optimizer, groups)
    # hpZ and qgZ both build node groups from every rank's group: learned once (a collective of the world)
    quantized = bool(config.quantize_gradients) and comm.distributed and comm.world_size > 1
    world_groups = _world_groups(comm) if config.secondary_partition or quantized else []
    secondary = _node_comm(comm, world_groups) if config.secondary_partition else None
    if quantized:
        groups_kw["grad_reduce"] = _quantized_reduce(comm, config, world_groups)
    if config.stage == 3:
        try:
            engine = Stage3Engine(model, groups, config, comm, device, units=units,
                                  verify_gather_order=verify_gather_order, weights=weights, replicate=replicate,
                                  secondary=secondary, **groups_kw)
        finally:
            if pending is not None:
                weights.close()
    else:
        engine = ZeroEngine(model, groups, config, comm, device, bucket_units=units, replicate=replicate, **groups_kw)
    if tp_group is not None:
        engine.norm_group = Communicator(tp_group, device=device)
    if config.mlp_tiles > 1 and mlp_tiles_of(model) == 1:  # See [Note: tiled MLP]
        enable_tiled_mlp(model, config.mlp_tiles)
    if hasattr(model, "_set_gradient_checkpointing"):
        policy = CheckpointPolicy(partition=config.partition_activations, cpu=config.cpu_checkpointing,
                                  contiguous=config.contiguous_checkpoints)
        enable_checkpointing(model, policy, engine.norm_group)
    zero_optimizer = ZeroOptimizer(engine, optimizer)
    setattr(model, _ENGINE_ATTR, engine)
    if pending is not None:
        release_pending(model)
    global _prepared_count
    _prepared_count += 1
    model.no_sync = engine.no_sync  # the DDP-style context accelerate and Trainer look for
    if config.stage == 3 and comm.world_size > 1 and hasattr(model, "generate"):
        _sync_generate(model)
    return model, zero_optimizer


def _sync_generate(model: nn.Module) -> None:
    """Stage 3: every forward is collective, so ranks must keep stepping ``generate`` until all are done
    (transformers' ``synced_gpus``); without it a rank that reaches EOS first leaves the others hanging.

    ``synced_gpus=False`` is overridden too: callers such as ``Seq2SeqTrainer`` pass False unless they
    detect DeepSpeed or FSDP, and a partitioned model cannot generate unsynced at world > 1.
    """
    generate = model.generate

    def synced_generate(*args, **kwargs):
        if kwargs.get("synced_gpus") is False:
            logger.debug("stage 3: generate(synced_gpus=False) overridden: every forward is a collective")
        kwargs["synced_gpus"] = True
        return generate(*args, **kwargs)

    model.generate = functools.wraps(generate)(synced_generate)


def get_engine(obj: nn.Module | torch.optim.Optimizer) -> ZeroEngine:
    """The engine behind a prepared model or its ZeroOptimizer."""
    engine = getattr(obj, _ENGINE_ATTR, None) or getattr(obj, "engine", None)
    if not isinstance(engine, ZeroEngine):
        raise ValueError(f"{type(obj).__name__} was not prepared by hfzero.prepare")
    return engine


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
    from hfzero.parallel.mesh import build_shard_mesh, check_shard_size

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


def _node_comm(comm: Communicator, groups: list[tuple[int, ...]]) -> Communicator | None:
    """hpZ: a communicator over the ranks of ``comm``'s group on this rank's node (sharing its statistics), or None
    when no group crosses a node or each node holds one rank of it (nothing would change). Every rank learns every
    rank's group (``_world_groups``) and creates every node part of every group, in the same order (a collective of
    the world), so any group layout works: the world, HSDP shard groups, a pipeline's stages, a tensor-parallel
    dp or shard group (ranks tp apart), provided each node holds the same number k of each group's ranks, k
    dividing the group's size (the slices are ``full.view(k, -1)``). Decided from world-wide facts, so every rank
    takes the same branch. ``groups``: every rank's group, from ``_world_groups``."""
    per_node = comm.ranks_per_node
    parts = [[r for r in group if r // per_node == node] for group in groups
             for node in sorted({r // per_node for r in group})]
    sizes, counts = {len(group) for group in groups}, {len(part) for part in parts}
    if len(parts) == len(groups):
        logger.info("secondary_partition: each data-parallel group lies inside one node; nothing to do")
        return None
    if len(sizes) > 1 or len(counts) > 1 or next(iter(sizes)) % next(iter(counts)):
        raise ConfigError(f"hfzero.prepare: secondary_partition (hpZ) needs every node to hold the same number of each "
                          f"data-parallel group's ranks, dividing the group's size; with {per_node} ranks per node the "
                          f"groups of {sorted(sizes)} rank(s) are cut into parts of {sorted(counts)}: pick ranks per "
                          "node (or shard_size) so that nodes cut the groups evenly")
    if counts == {1}:
        logger.info("secondary_partition: each node holds one rank of each data-parallel group; nothing to keep local")
        return None
    mine = None
    for part in parts:
        group = dist.new_group(part)
        if dist.get_rank() in part:
            mine = comm.on_group(group)
    return mine


def _world_groups(comm: Communicator) -> list[tuple[int, ...]]:
    """Every rank's group of ``comm``'s kind (global ranks), each once, ordered by their first rank: gathered
    from every rank of the world (one small collective, which every rank reaches here)."""
    world = comm.on_group(dist.group.WORLD, share_stats=False)
    everyone = world.all_gather_bytes(json.dumps(comm.global_ranks).encode())
    return sorted({tuple(json.loads(payload)) for payload in everyone})


def _quantized_reduce(comm: Communicator, config: ZeroConfig, world_groups: list[tuple[int, ...]]):
    """qgZ: the hierarchical quantized reduce-scatter over ``comm``'s group (See [Note: quantized collectives] in
    hfzero/quantized_comm.py). As ``_node_comm``: every rank learns every rank's data-parallel group
    (``_world_groups``, a collective of the world) and creates every group's node parts and cross-node groups in the
    same order, so any layout works: the whole world, HSDP's shard groups, a pipeline stage's dp ranks or its shard
    groups, a tensor-parallel dp group (ranks tp apart). Every group is checked before any is created (nodes must cut
    each into equal parts), so every rank raises or none does. Called where the group has more than one rank."""
    from hfzero.quantized_comm import build_quantized_reduce

    groups = [list(group) for group in world_groups]
    return build_quantized_reduce(comm, config.quantize_gradients, config.quantize_block, groups,
                                  error_feedback=config.quantize_error_feedback)


def _check_process_group(group: dist.ProcessGroup | None) -> None:
    if dist.is_available() and dist.is_initialized():
        return
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if group is not None or world > 1:
        raise RuntimeError(
            f"hfzero.prepare: WORLD_SIZE={world} but torch.distributed is not initialized. Call "
            "torch.distributed.init_process_group(backend) first (gloo on CPU, nccl on CUDA), or launch "
            "with `hfzero run` / torchrun, which set up the environment it reads.")


def _optimizer_groups(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[list[nn.Parameter]]:
    if any(optimizer.state.values()):
        raise ConfigError("hfzero.prepare: the optimizer already has state (it has stepped); pass a fresh "
                          "optimizer and load saved state into the returned one with load_state_dict")
    model_params = {p: name for name, p in model.named_parameters()}
    groups: list[list[nn.Parameter]] = []
    seen: set[nn.Parameter] = set()
    for index, group in enumerate(optimizer.param_groups):
        params = []
        for p in group["params"]:
            if p not in model_params:
                raise ConfigError(
                    f"hfzero.prepare: optimizer param group {index} holds a tensor of shape {tuple(p.shape)} "
                    "that is not a parameter of the model; build the optimizer from model.parameters() (or "
                    "named subsets of them) of the same model object you pass to prepare")
            if p in seen:
                raise ConfigError(f"hfzero.prepare: parameter {model_params[p]!r} appears twice in the optimizer")
            seen.add(p)
            params.append(p)
        groups.append(params)
    missing = [n for p, n in model_params.items() if p.requires_grad and p not in seen]
    if missing:
        logger.warning("%d trainable parameter(s) are not in the optimizer and will not be synchronized or "
                       "updated (e.g. %s); freeze them with requires_grad_(False) or add them to the optimizer",
                       len(missing), missing[:3])
    return groups


def _read_pending(model: nn.Module, optimizer: torch.optim.Optimizer, config: ZeroConfig,
                  process_group: dist.ProcessGroup | None, pending: PendingWeights) -> WeightSource | None:
    """A model loaded under sharded loading: stage 3 gets a WeightSource for its shards (parameters the
    engine keeps whole are read whole first); stages 0-2 read every parameter whole, one at a time, and
    prepare as usual (None)."""
    distributed = dist.is_available() and dist.is_initialized()
    device = collective_device(process_group) if distributed else torch.device("cpu")
    for module in model.modules():
        for name, buf in module._buffers.items():
            if buf is not None and buf.device != device:
                module._buffers[name] = buf.to(device)
    source = pending.source(model, device)
    if config.stage != 3:
        try:
            materialize_whole(model, source)
        finally:
            source.close()
        release_pending(model)
        return None
    in_optimizer = {p for group in optimizer.param_groups for p in group["params"]}
    whole = [n for n, p in model.named_parameters()
             if (p.numel() < config.param_persistence_threshold if not p.requires_grad else p not in in_optimizer)]
    materialize_whole(model, source, whole)
    return source


def _single_device(groups: list[list[nn.Parameter]]) -> torch.device:
    devices = {p.device for group in groups for p in group}
    if not devices:
        raise ConfigError("hfzero.prepare: the optimizer holds no parameters")
    if len(devices) > 1:
        raise ConfigError(f"hfzero.prepare: parameters are spread over devices {sorted(map(str, devices))}; "
                          "move the model to one device (model.to(device)) before prepare")
    device = devices.pop()
    if device.type == "meta":
        raise ConfigError("hfzero.prepare: parameters are on the meta device; materialize the model "
                          "(e.g. from_pretrained or to_empty + load) before prepare")
    return device


def _meta_device(groups: list[list[nn.Parameter]], device: torch.device) -> torch.device:
    """Sharded construction: the trainable parameters are on meta; the shard goes to ``device``."""
    if not any(groups):
        raise ConfigError("hfzero.prepare: the optimizer holds no parameters")
    real = sorted({str(p.device) for group in groups for p in group if p.device.type != "meta"})
    if real:
        raise ConfigError(f"hfzero.prepare: with weights= every trainable parameter must be on the meta device; "
                          f"some are on {real}")
    return torch.device(device)


def _check_ranks_agree(comm: Communicator, config: ZeroConfig, model: nn.Module,
                       optimizer: torch.optim.Optimizer, groups: list[list[nn.Parameter]]) -> None:
    """All ranks must pass the same config, optimizer and parameter shapes; name what differs."""
    if comm.world_size == 1:
        return
    names = {p: n for n, p in model.named_parameters()}
    facts = {
        "config": config.to_dict(),
        "optimizer": type(optimizer).__name__,
        "param_groups": [[[names[p], list(p.shape), str(p.dtype)] for p in g] for g in groups],
    }
    payload = json.dumps(facts, sort_keys=True, default=str).encode()
    everyone = comm.all_gather_bytes(hashlib.sha256(payload).digest())
    if len(set(everyone)) == 1:
        return
    reports = [json.loads(b) for b in comm.all_gather_bytes(payload)]
    problems = []
    for rank, other in enumerate(reports):
        for key in ("config", "optimizer", "param_groups"):
            if other[key] != reports[0][key]:
                if key == "config":
                    fields = sorted(k for k in other[key] if other[key][k] != reports[0][key].get(k))
                    detail = ", ".join(f"{f}={other[key][f]!r} (rank 0: {reports[0][key][f]!r})" for f in fields)
                    problems.append(f"rank {rank} config differs: {detail}")
                else:
                    problems.append(f"rank {rank} {key} differs from rank 0")
    raise ConfigError("hfzero.prepare: ranks disagree; every rank must pass the same model, optimizer and "
                      "config. " + "; ".join(problems))
