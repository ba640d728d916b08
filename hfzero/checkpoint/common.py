"""Pieces shared by save and load: the model's tensor inventory and the ranks' agreement on errors."""

from __future__ import annotations

import dataclasses
import json
import types
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from hfzero.checkpoint.errors import CheckpointError
from hfzero.checkpoint.tensor_parallel import refuse_sharded_frozen, replicated_names, tp_info
from hfzero.comm.collectives import Communicator
from hfzero.logging import get_logger
from hfzero.runtime.engine import ZeroEngine
from hfzero.runtime.engine import get_engine

logger = get_logger(__name__)


def engine_of(model: nn.Module, optimizer: torch.optim.Optimizer) -> ZeroEngine:
    """The engine of a prepared model, checking that ``optimizer`` is the one prepare returned with it."""
    engine = get_engine(model.module if _is_pipeline(model) else model)
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


def guard(fn: Callable[[], Any], what: str) -> str | None:
    """Runs ``fn``: None when it returns, else its exception in one line (logged with the traceback as ``what``
    failing), for ``agree`` to raise on every rank."""
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - reported to every rank by agree(), then raised there
        logger.exception("%s failed", what)
        return f"{type(exc).__name__}: {exc}"
    return None


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


# ---- scope: which ranks a checkpoint spans and how names map ----------------------------------------
# [Note: pipeline checkpoints]
# Under ``hfzero.pipeline`` each rank's engine holds one stage's parameters, sharded over the stage's dp
# group. A checkpoint of a Pipeline is still one checkpoint of the whole model, in the same format:
# - every rank of the pp x dp world writes ``rank<global>-of-<world>``: the ranges its engine writes
#   within its dp group (owned slices; at ZeRO-0 the dp ranks split each bucket), under the whole
#   model's HF names (the stage modules keep them; multi-stage chunks drop their "<chunk>." prefix);
# - the tied embedding is written once, by the first stage; the last stage's copy (``lm_head.weight``)
#   is an alias of it, as in the whole model's own manifest, and reads the canonical tensor on load;
# - param groups are the user's optimizer's: the tied embedding's group of its own (see [Note: tied
#   embeddings] in the pipeline driver) maps back to the group it came from; each stage reports its
#   part of every group and rank 0 merges them in pp order (so ``order`` is the whole model's);
# - frozen tensors: dp rank 0 of each stage writes its stage's into ``frozen-pp<p>.safetensors``;
# - the manifest records ``pipeline`` (pp and dp sizes, schedule, the stages of each rank) for reading only:
#   loading never needs it, so a pipeline checkpoint loads at pp=1 (any dp, any stage) and a pp=1
#   checkpoint loads into any pipeline. On load each stage checks that its names are in the
#   checkpoint and, with the other stages (an all-gather of names), that together they hold it all.
def _is_pipeline(model: Any) -> bool:
    from hfzero.parallel.pipeline import Pipeline

    return isinstance(model, Pipeline)


@dataclasses.dataclass(frozen=True)
class Scope:
    """Where this rank's engine sits in a checkpoint. See [Note: pipeline checkpoints].

    Attributes:
        module: the prepared module whose tensors this rank saves or loads.
        comm: every rank of the checkpoint (the engine's group, or the whole pp x dp world).
        rank: this rank's file index among ``world_size``.
        world_size: rank files of the checkpoint.
        name: engine/module name -> checkpoint name (the whole model's HF name).
        groups: engine param group index -> checkpoint param group index (the user's optimizer's).
        num_groups: param groups of the checkpoint.
        skip: checkpoint names this rank neither writes nor lists (a tied copy another stage writes).
        aliases: tied checkpoint names -> their canonical name, added to the inventory's.
        tied_targets: names the whole model re-ties on load (None: the module's own).
        writes_frozen: whether this rank writes its module's frozen tensors (one rank per stage).
        frozen_file: the file they go to.
        configs: an object with the HF ``config`` / ``generation_config`` rank 0 writes.
        pipeline: this rank's pipeline coordinates for the manifest (None without a pipeline): pp and dp
            sizes, schedule, ``stages`` (the stage indices it runs).
        tensor_parallel: tp and dp sizes for the manifest under tensor parallelism (None without); see
            [Note: tensor-parallel checkpoints] in tensor_parallel.py.
        expert_parallel: ep and edp sizes for the manifest under expert parallelism (None without); see
            ``_expert_parallel_scope``.
    """

    module: nn.Module
    comm: Communicator
    rank: int
    world_size: int
    name: Callable[[str], str]
    groups: list[int]
    num_groups: int
    skip: frozenset[str] = frozenset()
    aliases: dict[str, str] = dataclasses.field(default_factory=dict)
    tied_targets: list[str] | None = None
    writes_frozen: bool = True
    frozen_file: str = "frozen.safetensors"
    configs: Any = None
    pipeline: dict[str, Any] | None = None
    tensor_parallel: dict[str, int] | None = None
    expert_parallel: dict[str, int] | None = None
    writes_shard: bool = True
    """Whether this rank writes its engine's master and optimizer-state slices: False on the replicas of an
    HSDP shard (replicate rank > 0), which hold the same slices as replicate rank 0's shard group."""

    @property
    def spans_stages(self) -> bool:
        """True when the checkpoint's ranks hold different parts of the model (pipeline stages)."""
        return self.pipeline is not None


def scope_of(model: Any, optimizer: torch.optim.Optimizer) -> tuple[ZeroEngine, Scope]:
    """The engine and the checkpoint scope of ``model``: a prepared model or a ``hfzero.pipeline`` Pipeline."""
    engine = engine_of(model, optimizer)
    groups = list(range(len(engine.optimizer.param_groups)))
    if engine.expert_comm is not None:
        return engine, _expert_parallel_scope(model, engine, groups)
    if _is_pipeline(model):
        return engine, _pipeline_scope(model, engine, groups)
    if tp_info(model) is not None:
        return engine, _tensor_parallel_scope(model, engine, groups)
    if engine.replicate is not None:
        return engine, _hsdp_scope(model, engine, groups)
    return engine, Scope(model, engine.comm, engine.rank, engine.world_size, lambda n: n, groups, len(groups),
                         writes_frozen=engine.rank == 0, configs=model)


def _hsdp_scope(model: nn.Module, engine: ZeroEngine, groups: list[int]) -> Scope:
    """HSDP (See [Note: hierarchical sharding] in runtime/engine.py): every rank of the world writes a file (its
    RNG states); only replicate rank 0's shard group writes master and optimizer-state slices, so each element
    is saved once and the checkpoint is the same as a flat one's (it loads at any shard size and world)."""
    import torch.distributed as dist

    world = engine.comm.on_group(dist.group.WORLD, share_stats=False)
    return Scope(model, world, dist.get_rank(), dist.get_world_size(), lambda n: n, groups, len(groups),
                 writes_frozen=dist.get_rank() == 0, configs=model, writes_shard=engine.replicate.rank == 0)


def _tensor_parallel_scope(model: nn.Module, engine: ZeroEngine, groups: list[int]) -> Scope:
    """See [Note: tensor-parallel checkpoints] in tensor_parallel.py: every rank of the dp x tp world writes a
    file; parameters replicated over TP are written by TP rank 0's ranks only; under HSDP x TP only replicate rank
    0's shard groups write slices (as ``_hsdp_scope``)."""
    import torch.distributed as dist

    tp, tp_rank, dp = tp_info(model)
    refuse_sharded_frozen(model)
    world = engine.comm.on_group(dist.group.WORLD, share_stats=False)
    skip = frozenset(replicated_names(engine)) if tp_rank > 0 else frozenset()
    return Scope(model, world, dist.get_rank(), dist.get_world_size(), lambda n: n, groups, len(groups), skip=skip,
                 writes_frozen=dist.get_rank() == 0, configs=model, tensor_parallel={"tp_size": tp, "dp_size": dp},
                 writes_shard=engine.replicate is None or engine.replicate.rank == 0)  # HSDP x TP: one replica


def _expert_parallel_scope(model: nn.Module, engine: ZeroEngine, groups: list[int]) -> Scope:
    """An edp x ep model (hfzero/parallel/expert.py) is checkpointed as a TP one is ([Note: tensor-parallel
    checkpoints] in tensor_parallel.py): every rank of the world writes a file; the experts are DTensors sharded
    on dim 0 over the 1-D EP mesh, so each rank's ranges map to whole-parameter ranges the same way. The engine
    shards the dense parameters over the world and the experts over edp ([Note: bucket partitions] in
    runtime/layout.py): each rank writes its slices of both (at stage 0, where every rank holds its buckets
    whole, its part of each bucket split over the bucket's partition group: checkpoint/ranges.py), so each
    element is written once. Loading maps the pieces to any layout (another ep size, no EP, any stage) and
    ``hfzero consolidate`` writes whole experts."""
    import torch.distributed as dist

    refuse_sharded_frozen(model)
    world = engine.comm.on_group(dist.group.WORLD, share_stats=False)
    edp = engine.expert_comm.world_size
    return Scope(model, world, dist.get_rank(), dist.get_world_size(), lambda n: n, groups, len(groups),
                 writes_frozen=dist.get_rank() == 0, configs=model,
                 expert_parallel={"ep_size": dist.get_world_size() // edp, "edp_size": edp})


def _pipeline_scope(pipe: Any, engine: ZeroEngine, groups: list[int]) -> Scope:
    """See [Note: pipeline checkpoints]."""
    import torch.distributed as dist

    mesh = pipe.mesh
    world = engine.comm.on_group(dist.group.WORLD, share_stats=False)
    num_groups = len(groups) - (1 if pipe.tied_user_group is not None else 0)
    if pipe.tied_user_group is not None:  # the tied embedding's own group is the user's group it came from
        groups[-1] = pipe.tied_user_group
    skip, aliases, targets = frozenset(), {}, None
    if pipe.tied_names is not None:
        canonical, copy = pipe.tied_names
        aliases, targets = {copy: canonical}, [copy]
        if not pipe.holds_first:
            skip = frozenset({copy})
    stage_ids = [s.stage_index for s in pipe.stages]
    return Scope(pipe.module, world, dist.get_rank(), dist.get_world_size(), pipe.hf_name, groups, num_groups,
                 skip=skip, aliases=aliases, tied_targets=targets, writes_frozen=mesh.dp_rank == 0,
                 writes_shard=engine.replicate is None or engine.replicate.rank == 0,  # HSDP inside the stages
                 frozen_file=f"frozen-pp{mesh.pp_rank:05d}.safetensors",
                 configs=types.SimpleNamespace(config=pipe.stages[0].config,
                                               generation_config=pipe.generation_config),
                 pipeline={"pp_size": mesh.pp_size, "dp_size": mesh.dp_size, "schedule": pipe.kind.name,
                           "stages": stage_ids})
