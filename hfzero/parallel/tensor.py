"""Tensor parallelism x ZeRO: a dp x tp mesh, a model sharded over "tp" with its transformers tp_plan,
and ZeRO over "dp".

[Note: tensor-parallel parameters]
A TP-sharded parameter is a DTensor whose local tensor is this rank's shard; parameters the plan does
not name (norms, embeddings) stay plain tensors replicated over the TP group. The ZeRO engine never
sees a DTensor's global shape: the layout sizes every parameter by its local tensor, the engine copies
the local tensor into its flat buffer and re-points the local tensor's ``.data`` at its view, and the
reducer takes the local tensor of each gradient (``runtime.tensors.local_tensor``). So each rank's ZeRO
shards its local TP shard over the dp group, exactly as it would a smaller model. The global gradient
norm adds the TP group's sums, counting parameters replicated over TP once (TP rank 0's). Activations
between layers are plain replicated tensors (``use_local_output``), which is what P_a partitions.
At stage 3 the same holds for the partitioned parameters: each rank's PARAM_SHARD is 1/dp of its local TP
shards, a unit's gather fills the DTensor's local tensor (PARAM_GATHERED: the unit's local shards, 1/tp of
the unit) and between uses the local tensor is 0-element while the DTensor keeps its global shape.
``hfzero.full_state_dict`` and the checkpoints (hfzero/checkpoint/tensor_parallel.py) make shards whole.

Rank layout: ``rank = dp_rank * tp_size + tp_rank`` (TP ranks are neighbours, as on a node).

With ``ZeroConfig.shard_size`` G below the dp size (HSDP x TP) each TP rank's dp group is cut into shard groups
of G consecutive dp ranks (a dp_replicate x dp_shard x tp mesh, ``build_tensor_shard_groups`` in
hfzero/parallel/mesh.py): ZeRO shards the local TP shards over the shard group and replicates them over the
dp / G shard groups, as [Note: hierarchical sharding] in runtime/engine.py describes without TP.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from hfzero.config import ConfigError, ZeroConfig
from hfzero.logging import get_logger
from hfzero.parallel.mesh import build_tensor_shard_groups, check_divides, split_world_mesh

if TYPE_CHECKING:
    from hfzero.runtime.optimizer import ZeroOptimizer

logger = get_logger(__name__)


@dataclasses.dataclass(frozen=True)
class TensorMesh:
    """The calling rank's place in a dp x tp mesh.

    Attributes:
        mesh: the DeviceMesh with dimensions ("dp", "tp").
        dp_size: data-parallel replicas; tp_size: ranks sharing one model replica.
        dp_rank, tp_rank: this rank's coordinates.
        dp_group: ranks with the same tp_rank (ZeRO runs here); tp_group: ranks of one replica.
    """

    mesh: DeviceMesh
    dp_size: int
    tp_size: int
    dp_rank: int
    tp_rank: int
    dp_group: dist.ProcessGroup
    tp_group: dist.ProcessGroup


def check_tp_size(world_size: int, tp_size: int) -> int:
    """The dp size for ``tp_size`` over ``world_size`` ranks; a clear error when it does not divide."""
    return check_divides(world_size, "tp_size", tp_size, "data-parallel")


def build_tp_mesh(tp_size: int) -> TensorMesh:
    """The dp x tp mesh over the whole world (collective: every rank calls it)."""
    mesh, dp_size = split_world_mesh("tensor parallelism", "tp_size", tp_size, ("dp", "tp"))
    dp_rank, tp_rank = mesh.get_coordinate()
    return TensorMesh(mesh, dp_size, tp_size, dp_rank, tp_rank, mesh.get_group("dp"), mesh.get_group("tp"))


def tp_plan(model: nn.Module) -> dict[str, str]:
    """The model's transformers TP plan as {module path pattern: style}, paths from the top module.

    The decoder's ``base_model_tp_plan`` (config) is prefixed with the base model's attribute. The
    output layer's plan (``colwise_gather_output``) is left out: ``lm_head`` stays replicated, so
    logits and the loss are whole on every TP rank.
    """
    config = getattr(model, "config", None)
    plan = dict(getattr(config, "base_model_tp_plan", None) or {})
    if not plan:
        raise ConfigError(
            f"hfzero: {type(model).__name__} has no tensor-parallel plan (config.base_model_tp_plan is empty). "
            "Give one: config.base_model_tp_plan = {'layers.*.self_attn.q_proj': 'colwise', "
            "'layers.*.self_attn.o_proj': 'rowwise', ...} (styles 'colwise' and 'rowwise'), or shard the model "
            "yourself with torch.distributed.tensor.parallel.parallelize_module and pass tp_group to hfzero.prepare")
    prefix = getattr(model, "base_model_prefix", "")
    if prefix and hasattr(model, prefix):
        plan = {f"{prefix}.{path}": style for path, style in plan.items()}
    return plan


def check_heads(model: nn.Module, tp_size: int) -> None:
    """Attention heads (and key/value heads) must split evenly over the TP group."""
    config = getattr(model, "config", None)
    for attr in ("num_attention_heads", "num_key_value_heads"):
        heads = getattr(config, attr, None)
        if isinstance(heads, int) and heads % tp_size:
            raise ConfigError(f"hfzero: tp_size={tp_size} does not divide {attr}={heads} of "
                              f"{type(model).__name__}; choose a tp_size that divides it")


def apply_tensor_parallel(model: nn.Module, mesh: TensorMesh) -> nn.Module:
    """Shard ``model``'s planned linear layers over ``mesh``'s "tp" dimension (in place; returns it).

    Every TP rank must hold the same full weights beforehand (same seed or the same checkpoint).
    """
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from hfzero.runtime.compile import TP_REFUSAL, is_compiled, tensor_parallel_compiles
    from hfzero.runtime.torch_api import is_compile_wrapper

    # every rank holds the same model: all raise together
    if any(is_compile_wrapper(m) for m in model.modules()):  # its children sit under `_orig_mod`: no plan matches
        raise ConfigError("hfzero tensor parallelism: the model is a torch.compile wrapper, whose layers the "
                          "model's TP plan does not name; pass the model itself and compile after "
                          "prepare_tensor_parallel (torch>=2.14), or use hfzero.compile_regions(model) before it")
    if not tensor_parallel_compiles() and is_compiled(model):
        raise ConfigError("hfzero tensor parallelism: the model's blocks are compiled (hfzero.compile_regions); "
                          + TP_REFUSAL.format(version=torch.__version__))
    planned = tp_plan(model)
    check_heads(model, mesh.tp_size)
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    plan = {}
    for path, style in planned.items():
        if style not in styles:
            raise ConfigError(f"hfzero: TP style {style!r} of {path!r} is not supported; use 'colwise' or 'rowwise'")
        plan[path] = styles[style]()
    return parallelize_module(model, mesh.mesh["tp"], plan)


def repoint_optimizer(optimizer: torch.optim.Optimizer, before: dict[int, str], model: nn.Module) -> None:
    """Point ``optimizer``'s param groups at ``model``'s parameters of the same names (in place).

    ``before`` maps ``id(parameter)`` to its name before ``parallelize_module`` replaced the parameters
    with DTensor ones; the optimizer must not have stepped (its state is keyed by the old objects).
    """
    if any(optimizer.state.values()):
        raise ConfigError("hfzero tensor parallelism: the optimizer already has state (it has stepped); build it "
                          "fresh over the model, shard over TP, then load saved state into the prepared optimizer")
    now = dict(model.named_parameters())
    for group in optimizer.param_groups:
        missing = [p for p in group["params"] if id(p) not in before]
        if missing:
            raise ConfigError("hfzero tensor parallelism: the optimizer holds a tensor that is not a parameter of "
                              "the model; build the optimizer from model.parameters()")
        group["params"] = [now[before[id(p)]] for p in group["params"]]


def shard_model_and_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer, mesh: TensorMesh) -> None:
    """Shard ``model`` over ``mesh``'s "tp" dimension and re-point ``optimizer`` (built over the unsharded
    model, not stepped yet) at the new DTensor parameters: how the Trainer and ZeroAccelerator, which
    build the optimizer before preparing, get TP."""
    before = {id(p): name for name, p in model.named_parameters()}
    apply_tensor_parallel(model, mesh)
    repoint_optimizer(optimizer, before, model)


def prepare_tensor_parallel(
        model: nn.Module,
        optimizer_factory: Callable[[Iterator[nn.Parameter]], torch.optim.Optimizer] | torch.optim.Optimizer,
        config: ZeroConfig) -> tuple[nn.Module, ZeroOptimizer, TensorMesh]:
    """Build the dp x tp mesh, shard ``model`` over tp and prepare ZeRO over dp (stages 0-3).

    ``optimizer_factory(params)`` builds the optimizer over the TP-sharded parameters (it must be built
    after sharding, which replaces them); an optimizer already built over the unsharded model is taken
    too (re-pointed at the sharded parameters). Returns (model, optimizer, mesh).
    ``config.shard_size`` G below the dp size: HSDP over each TP rank's dp group (ZeRO over shard groups of G
    dp ranks, replicated over the dp / G of them; see the module docstring).
    """
    from hfzero.parallel.data_parallel import prepare

    mesh = build_tp_mesh(config.tp_size)
    groups = {"process_group": mesh.dp_group}
    if config.shard_size and config.shard_size != mesh.dp_size:  # HSDP x TP; a bad size is refused before sharding
        groups["process_group"], groups["replicate_group"] = build_tensor_shard_groups(
            mesh.dp_size, mesh.tp_size, config.shard_size)
    if isinstance(optimizer_factory, torch.optim.Optimizer):
        optimizer = optimizer_factory
        shard_model_and_optimizer(model, optimizer, mesh)
    else:
        apply_tensor_parallel(model, mesh)
        optimizer = optimizer_factory(model.parameters())
    model, optimizer = prepare(model, optimizer, config, tp_group=mesh.tp_group, **groups)
    sharded = sum(isinstance(p, DTensor) for p in model.parameters())
    hsdp = f" (HSDP: sharded over {config.shard_size}, replicated x{mesh.dp_size // config.shard_size})" \
        if "replicate_group" in groups else ""
    logger.info("tensor parallelism: dp=%d x tp=%d, %d parameter(s) sharded over tp, ZeRO stage %s over dp%s%s",
                mesh.dp_size, mesh.tp_size, sharded, config.stage, hsdp,
                ", P_a (checkpoints partitioned over tp)" if config.partition_activations else "")
    return model, optimizer, mesh
