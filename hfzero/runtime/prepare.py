"""The engine side of ``hfzero.prepare``: check the arguments, place and cast the model, read pending weights, build
the communicators (their scratch on the model's device, or on the CPU under gloo), the engine and the sharded
optimizer over the groups it is given (``EngineGroups``: resolved by ``hfzero.prepare`` in
parallel/data_parallel.py, which builds meshes; nothing here does)."""

from __future__ import annotations

import functools
import hashlib
import json
import os
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from hfzero.comm.collectives import Communicator
from hfzero.comm.hierarchy import node_comm, world_groups
from hfzero.comm.quantized import build_quantized_reduce
from hfzero.config import STAGE_AUTO, ConfigError, ZeroConfig
from hfzero.devices import backend_map, collective_device, scratch_device, with_index
from hfzero.logging import get_logger
from hfzero.runtime.activations.checkpoint import CheckpointPolicy, enable_checkpointing
from hfzero.runtime.activations.tiled_mlp import enable_tiled_mlp, mlp_tiles_of
from hfzero.runtime.engine import ENGINE_ATTR, ZeroEngine
from hfzero.runtime.groups import EngineGroups
from hfzero.runtime.hostmem import configure_host_allocator
from hfzero.runtime.lifetime import Installed
from hfzero.runtime.optimizer import ZeroOptimizer
from hfzero.runtime.placement import check_placement
from hfzero.runtime.pending import PendingWeights, find_pending, materialize_whole
from hfzero.runtime.pending import release as release_pending
from hfzero.runtime.stage3 import Stage3Engine
from hfzero.runtime.stage3.weights import WeightSource, materialize_meta_params

logger = get_logger(__name__)

_prepared_count = 0
"""Models this process prepared (``hfzero run`` reports a script that prepared none; see launch.py)."""


def prepared_count() -> int:
    """How many models ``prepare`` has applied ZeRO to in this process."""
    return _prepared_count


def check_arguments(model: nn.Module, optimizer: torch.optim.Optimizer, config: ZeroConfig | None,
                    process_group: dist.ProcessGroup | None, units: Sequence[str] | None,
                    weights: WeightSource | None) -> ZeroConfig:
    """The checks of ``prepare``'s own arguments, before any group is built or any collective runs; returns the
    config (a default one for None)."""
    config = config or ZeroConfig()
    if not isinstance(config, ZeroConfig):
        raise ConfigError(f"hfzero.prepare: config must be a hfzero.ZeroConfig, got {type(config).__name__}")
    if not isinstance(model, nn.Module):
        raise TypeError(f"hfzero.prepare: model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError("hfzero.prepare: optimizer must be a torch.optim.Optimizer built over the model's "
                        f"parameters, got {type(optimizer).__name__}")
    if getattr(model, ENGINE_ATTR, None) is not None:
        raise ConfigError("hfzero.prepare: this model was already prepared; prepare a model once")
    if config.stage == STAGE_AUTO:
        raise ConfigError('hfzero.prepare: ZeroConfig(stage="auto") must be resolved first: '
                          "config = hfzero.planning.autostage.resolve_auto_stage(config, model, optimizer, "
                          "world_size=...) (the Trainer and ZeroAccelerator do this for you)")
    _check_process_group(process_group)
    if units is not None and (isinstance(units, str) or not all(isinstance(u, str) for u in units)):
        raise ConfigError("hfzero.prepare: units must be a list of module names, e.g. ['model.layers.0']")
    if weights is not None and config.stage != 3:
        raise ConfigError("hfzero.prepare: weights= (sharded construction) applies to ZeroConfig(stage=3) only")
    if mlp_tiles_of(model) not in (1, config.mlp_tiles):
        raise ConfigError(f"hfzero.prepare: config.mlp_tiles={config.mlp_tiles} but the model's MLPs are tiled in "
                          f"{mlp_tiles_of(model)}; pass the same mlp_tiles (prepare tiles them itself)")
    return config


def prepare_engine(model: nn.Module, optimizer: torch.optim.Optimizer, config: ZeroConfig, groups: EngineGroups, *,
                   units: Sequence[str] | None = None, verify_gather_order: bool = True,
                   weights: WeightSource | None = None) -> tuple[nn.Module, ZeroOptimizer]:
    """Build the engine and the sharded optimizer over ``groups`` (resolved by ``hfzero.prepare``, which documents
    every argument: parallel/data_parallel.py). Collective: every rank calls it at the same point."""
    config = check_arguments(model, optimizer, config, groups.shard, units, weights)
    process_group = groups.shard
    pending = find_pending(model) if weights is None else None
    if pending is not None:  # See [Note: pending weights] in runtime/pending.py
        weights = _read_pending(model, optimizer, config, process_group, pending)
    params = _optimizer_groups(model, optimizer)
    # a model with nothing to train (a frozen reference model, stage 3): placed by its frozen parameters
    placed = params if any(params) or config.stage != 3 else [[p for p in model.parameters() if not p.requires_grad]]
    # See [Note: device index] in hfzero/devices.py: ``weights.device`` may be "cuda" without an index
    device = with_index(_single_device(placed) if weights is None else _meta_device(placed, weights.device))
    check_placement(device, process_group)  # before any collective: a clear error, not an NCCL one
    if config.mixed_precision:
        model.to(config.torch_dtype)
    if weights is not None:  # trainable and frozen parameters left on meta get their shard from ``weights``
        frozen = [p for p in model.parameters() if not p.requires_grad]
        materialize_meta_params([p for group in params for p in group] + frozen, device)
    if device.type == "cpu":
        # glibc's own trim of the heap's top stays unless the growth-triggered trim replaces it.
        by_growth = config.host_trim and config.host_trim_slack > 0
        configure_host_allocator(config.host_mmap_threshold, top_trim=not by_growth)  # See [Note: host allocator]
    # scratch on the CPU under gloo, on the model's device under NCCL: See [Note: collective device] in devices.py
    scratch = scratch_device(device, backend_map(process_group))
    comm = Communicator(process_group, config.reduce_scatter_impl, device=scratch, ranks_per_node=config.ranks_per_node)
    replicate = comm.on_group(groups.replicate) if groups.replicate is not None else None  # counted with comm's
    _check_ranks_agree(comm, config, model, optimizer, params)
    groups_kw = {"average_over": groups.average_over}
    if groups.expert is not None:  # See [Note: bucket partitions] in layout.py; counted with comm's
        groups_kw["expert_comm"] = comm.on_group(groups.expert)
    if replicate is not None:  # the other shard groups too: the whole world passes the same
        _check_ranks_agree(replicate.on_group(replicate.group, share_stats=False), config, model, optimizer, params)
    # hpZ and qgZ both build node groups from every rank's group: learned once (a collective of the world)
    quantized = bool(config.quantize_gradients) and comm.distributed and comm.world_size > 1
    everyone = world_groups(comm) if config.secondary_partition or quantized else []
    secondary = node_comm(comm, everyone) if config.secondary_partition else None
    if quantized:  # See [Note: quantized collectives] in comm/quantized.py
        groups_kw["grad_reduce"] = build_quantized_reduce(comm, config.quantize_gradients, config.quantize_block,
                                                          [list(group) for group in everyone],
                                                          error_feedback=config.quantize_error_feedback)
    if config.stage == 3:
        try:
            engine = Stage3Engine(model, params, config, comm, device, units=units,
                                  verify_gather_order=verify_gather_order, weights=weights, replicate=replicate,
                                  secondary=secondary, **groups_kw)
        finally:
            if pending is not None:
                weights.close()
    else:
        engine = ZeroEngine(model, params, config, comm, device, bucket_units=units, replicate=replicate, **groups_kw)
    if groups.tensor is not None:
        engine.norm_group = Communicator(groups.tensor, device=scratch_device(device, backend_map(groups.tensor)))
    # everything below that changes the user's model is recorded in engine.installed, for unprepare
    # (See [Note: engine lifetime] in lifetime.py)
    installed = engine.installed
    if config.mlp_tiles > 1 and mlp_tiles_of(model) == 1:  # See [Note: tiled MLP]
        enable_tiled_mlp(model, config.mlp_tiles, installed)
    if hasattr(model, "_set_gradient_checkpointing"):
        policy = CheckpointPolicy(partition=config.partition_activations, cpu=config.cpu_checkpointing,
                                  contiguous=config.contiguous_checkpoints)
        enable_checkpointing(model, policy, engine.norm_group, installed)
    zero_optimizer = ZeroOptimizer(engine, optimizer)
    installed.set_attr(model, ENGINE_ATTR, engine)
    if pending is not None:
        release_pending(model)
    global _prepared_count
    _prepared_count += 1
    installed.set_attr(model, "no_sync", engine.no_sync)  # the DDP-style context accelerate and Trainer look for
    if config.stage == 3 and comm.world_size > 1 and hasattr(model, "generate"):
        _sync_generate(model, installed)
    return model, zero_optimizer


def _sync_generate(model: nn.Module, installed: Installed) -> None:
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

    installed.set_attr(model, "generate", functools.wraps(generate)(synced_generate))


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
    """Sharded construction: the trainable parameters are on meta; the shard goes to ``device``. Frozen ones may
    be real: those the engine keeps whole (a frozen model's small ones, read whole by ``_read_pending``)."""
    if not any(groups):
        raise ConfigError("hfzero.prepare: the optimizer holds no parameters")
    real = sorted({str(p.device) for group in groups for p in group if p.device.type != "meta" and p.requires_grad})
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
