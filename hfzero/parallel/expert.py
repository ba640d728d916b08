"""Expert parallelism x ZeRO for mixture-of-experts models: an edp x ep mesh, each MoE layer's experts split
over "ep" by the model's own transformers ``base_model_ep_plan``, tokens exchanged by all-to-all, and ZeRO
over the world (dense parameters) and "edp" (experts).

[Note: expert parallelism x ZeRO]
Transformers 5 stores a MoE layer's experts as fused 3-D parameters (Qwen3-MoE ``mlp.experts.gate_up_proj``
[E, 2I, H], ``down_proj`` [E, H, I]) and names, in the config's ``base_model_ep_plan``, which parameters
split by expert (``grouped_gemm``: ``Shard(0)`` on the EP mesh) and which module reaches its experts through
a token exchange (``ep_dispatch_experts``). We apply that plan with transformers' own
``apply_expert_parallelism`` and its ``AllToAllEP``: each rank routes its own tokens (the router, top-k,
``norm_topk_prob`` and the auxiliary loss are the model's code, untouched), sends each (token, expert)
pair to the rank owning the expert with one all-to-all, runs its local experts and sends the outputs back
with a second; a rank whose tokens pick none of a layer's experts still takes part in both exchanges
(empty splits, its expert parameters kept in the graph), so no collective depends on the routing.

Every rank is a data-parallel replica reading its own batch (ep2 x dp2 on 4 ranks has the global batch of
4-rank DDP). The mesh is ``rank = edp_rank * ep_size + ep_rank``: the ranks of an EP group are neighbours
(as on a node), and the expert-data-parallel (edp) group of a rank is the ranks holding the same experts.
Expert parameters are DTensors whose local tensor is this rank's E / ep experts; dense parameters are
plain tensors, the same on every rank.

The ZeRO side is one engine over the whole world whose layout has two partitions ([Note: bucket partitions]
in runtime/layout.py): the dense parameters (plain tensors, the same on every rank) are sharded over the world,
as plain ZeRO shards them, and each rank's experts (the local tensors of the DTensor shards: its E / ep experts,
the same shapes on every rank, so every rank's layout is the same) over its edp group. A bucket holds
parameters of one partition only; its reduce-scatter (stage 0: all-reduce), stage 3's gathers and the post-step
all-gather run on its partition's communicator, in the one bucket order every rank shares. A dense gradient is
then the world's sum and an expert's the sum over the world of its tokens' (the all-to-all brought it its EP
group's tokens, the edp reduction adds the other EP groups'), both divided by the world size ([Note:
average_over] in runtime/engine.py). The gradient norm is one all-reduce over the world: each dense element is
owned by one rank of the world, each expert element by one rank of its edp group, and the edp groups hold
different experts (at stage 0, where buckets are whole, rank 0 of each partition group counts them). The step
agreement (stages 0-2), stage 3's step check and the overflow flag run over the world, the engine's group.
At stage 3 with ep = world the edp group is one rank: the experts stay whole on their rank while the dense
parameters are sharded over the world, so a rank holds 16 Psi_d / N + 16 Psi_e / N bytes (bf16 + Adam), plain
stage 3's; docs/moe.md gives the per-rank bytes. Why one engine, not a dense engine over the world beside an
expert engine over edp: the engine owns the model's hooks (stage 3's unit gathers register on the decoder blocks,
whose parameters are dense and expert alike; the step agreement; the reducer's graph roots), and two engines on
one model would each gather, check and broadcast the other's parameters.
On NCCL a step uses three communicators (the world's, the edp group's and the EP group's all-to-alls); each is
issued in the same order on every rank (bucket order, units in the recorded order, the model's layers), but only
gloo has run it here (see [Note: one communicator per data-parallel group] in runtime/stage3/engine.py for why
one communicator is preferred where it can be).
"""

from __future__ import annotations

import dataclasses
import re
import weakref
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from hfzero.comm.collectives import Communicator
from hfzero.config import ConfigError, ZeroConfig
from hfzero.logging import get_logger
from hfzero.parallel.mesh import check_divides, initialized_world_size, split_world_mesh
from hfzero.runtime.pending import find_pending

if TYPE_CHECKING:
    from hfzero.runtime.optimizer import ZeroOptimizer

logger = get_logger(__name__)

SUPPORTED_STYLES = ("grouped_gemm", "ep_dispatch_experts")
"""The EP plan styles applied: expert parameters split by expert, and the all-to-all token dispatch."""


@dataclasses.dataclass(frozen=True)
class ExpertMesh:
    """The calling rank's place in an edp x ep mesh.

    Attributes:
        mesh: the DeviceMesh with dimensions ("edp", "ep", "tp"); "tp" has size 1 (every rank holds its own
            batch; transformers' dispatch takes the ranks sharing a batch as its "tp" mesh).
        edp_size: ranks holding the same experts; ep_size: ranks splitting one layer's experts.
        edp_rank, ep_rank: this rank's coordinates.
        edp_group: ranks with the same ep_rank (ZeRO shards the experts here); ep_group: the ranks tokens travel
            between.
    """

    mesh: DeviceMesh
    edp_size: int
    ep_size: int
    edp_rank: int
    ep_rank: int
    edp_group: dist.ProcessGroup
    ep_group: dist.ProcessGroup


def check_ep_size(world_size: int, ep_size: int) -> int:
    """The edp size for ``ep_size`` over ``world_size`` ranks; a clear error when it does not divide."""
    return check_divides(world_size, "ep_size", ep_size, "expert-data-parallel")


def build_ep_mesh(ep_size: int) -> ExpertMesh:
    """The edp x ep mesh over the whole world (collective: every rank calls it)."""
    mesh, edp = split_world_mesh("expert parallelism", "ep_size", ep_size, ("edp", "ep", "tp"), inner=(1,))
    edp_rank, ep_rank, _ = mesh.get_coordinate()
    return ExpertMesh(mesh, edp, ep_size, edp_rank, ep_rank, mesh.get_group("edp"), mesh.get_group("ep"))


def ep_plan(model: nn.Module) -> dict[str, str]:
    """The model's transformers EP plan as {module or parameter path pattern: style}, paths from the top
    module (the decoder's ``base_model_ep_plan`` prefixed with the base model's attribute)."""
    config = getattr(model, "config", None)
    plan = dict(getattr(config, "base_model_ep_plan", None) or {})
    if not plan:
        raise ConfigError(
            f"hfzero: {type(model).__name__} has no expert-parallel plan (config.base_model_ep_plan is empty), so "
            "ep_size > 1 cannot split its experts. Use a mixture-of-experts model whose config has one (Qwen3-MoE, "
            "Mixtral, ...), or give one: config.base_model_ep_plan = {'layers.*.mlp.experts.gate_up_proj': "
            "'grouped_gemm', 'layers.*.mlp.experts.down_proj': 'grouped_gemm', 'layers.*.mlp.experts': "
            "'ep_dispatch_experts'}; or set ep_size=1")
    unknown = sorted({style for style in plan.values() if style not in SUPPORTED_STYLES})
    if unknown:
        raise ConfigError(f"hfzero: the EP plan of {type(model).__name__} uses style(s) {unknown}; hfzero applies "
                          f"{list(SUPPORTED_STYLES)} (experts split by expert, tokens dispatched by all-to-all)")
    prefix = getattr(model, "base_model_prefix", "")
    if prefix and hasattr(model, prefix):
        plan = {f"{prefix}.{path}": style for path, style in plan.items()}
    return plan


def expand_plan(model: nn.Module, plan: dict[str, str]) -> dict[str, str]:
    """The plan with each ``*`` pattern replaced by the model's concrete names: parameters first, then the
    modules that hold them (the order ``apply_expert_parallelism`` needs: shard, then hook)."""
    patterns = [(re.compile(re.escape(path).replace(r"\*", r"\d+")), style) for path, style in plan.items()]

    def match(name: str) -> str | None:
        return next((style for pattern, style in patterns if pattern.fullmatch(name)), None)

    params = {name: style for name, _ in model.named_parameters() if (style := match(name))}
    modules = {name: style for name, _ in model.named_modules() if (style := match(name))}
    if not params or not modules:
        raise ConfigError(f"hfzero: the EP plan of {type(model).__name__} ({sorted(plan)}) matches no "
                          f"{'expert parameter' if not params else 'experts module'} of the model")
    return {**params, **modules}


def check_experts(model: nn.Module, plan: dict[str, str], ep_size: int) -> None:
    """Every planned expert parameter's expert count (its first dimension) must split evenly over ``ep_size``."""
    params = dict(model.named_parameters())
    for name, style in plan.items():
        if style == "grouped_gemm" and name in params:
            experts = params[name].shape[0]
            if experts % ep_size:
                raise ConfigError(f"hfzero: ep_size={ep_size} does not divide the {experts} experts of {name}; "
                                  f"choose an ep_size that divides {experts}")


def check_expert_parallel(model: nn.Module, config: ZeroConfig, world_size: int) -> dict[str, str]:
    """Everything that can be refused before a collective runs: the sizes, the plan, the expert counts.
    Returns the expanded plan."""
    check_ep_size(world_size, config.ep_size)
    plan = expand_plan(model, ep_plan(model))
    check_experts(model, plan, config.ep_size)
    if find_pending(model) is not None:
        raise ConfigError("hfzero expert parallelism: the model was loaded under hfzero's sharded loading (its "
                          "weights are not read yet); load it with a plain from_pretrained before splitting experts")
    if any(isinstance(p, DTensor) for p in model.parameters()):
        raise ConfigError("hfzero expert parallelism: the model already has DTensor parameters (sharded by "
                          "another parallelism); pass an unsharded model")
    return plan


def _sync_from_rank0(model: nn.Module) -> None:
    """Start every rank from world rank 0's weights and buffers, before the split: expert sharding keeps each
    rank's own slice of its full expert tensors, and the engine's broadcast sends each expert bucket over its edp
    group only (from rank 0 of that group, which holds the same experts)."""
    world = Communicator(None)
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            world.broadcast(tensor.data)


class AllToAllLedger:
    """Where the expert all-to-alls are counted: ``comm`` (a Communicator over the EP group sharing the
    engine's statistics, set once the model is prepared; nothing is counted before) under the kind
    "all_to_all", so profiles and benchmarks see the token exchange beside ZeRO's own collectives."""

    def __init__(self) -> None:
        self.comm: Communicator | None = None

    def count(self, send_sizes: list[int], recv_sizes: list[int], hidden: torch.Tensor) -> None:
        """One dispatch and its combine: the rows of each exchange's input, the dispatched rows and the rows
        combined back (and again in backward, whose exchanges mirror them, when gradients flow), counted when the
        forward runs. As every kind is counted (an all-gather its whole output, a sequence-parallel all-to-all its
        whole input; [Note: node traffic] in hfzero/comm/collectives.py), the rows a rank keeps for its own experts are
        included: the volume is the buffer's, not the (S - 1) / S of it that leaves the rank."""
        if self.comm is None:
            return
        rows = sum(send_sizes) + sum(recv_sizes)
        passes = 2 if torch.is_grad_enabled() and hidden.requires_grad else 1
        self.comm.account("all_to_all", passes * rows * hidden.shape[-1], hidden.element_size())


def _counted_all_to_all(ledger: AllToAllLedger) -> type:
    """transformers' ``AllToAllEP`` (its dispatch and combine unchanged) with each exchange counted in ``ledger``.

    transformers keeps the class in a registry for the process's life: it reaches ``ledger`` (and its
    communicator) weakly, and the model holds the ledger (See [Note: engine lifetime] in runtime/lifetime.py)."""
    from transformers.distributed.expert_parallel import AllToAllEP

    ledger_ref = weakref.ref(ledger)

    class CountedAllToAll(AllToAllEP):
        def _dispatch_tokens(self, hidden_states, top_k_index, top_k_weights):
            out = super()._dispatch_tokens(hidden_states, top_k_index, top_k_weights)
            state, counted = out[3], ledger_ref()
            if counted is not None:
                counted.count(state.send_sizes, state.recv_sizes, hidden_states)
            return out

    return CountedAllToAll


_IMPLEMENTATION = "hfzero_all_to_all"


def apply_expert_parallel(model: nn.Module, mesh: ExpertMesh, plan: dict[str, str]) -> AllToAllLedger:
    """Split ``model``'s experts over ``mesh``'s "ep" dimension by its expanded EP ``plan`` with transformers'
    ``apply_expert_parallelism`` and its all-to-all dispatch (in place); returns the ledger its exchanges are
    counted in."""
    from transformers.distributed.expert_parallel import EPImplementationInterface, apply_expert_parallelism

    _sync_from_rank0(model)
    ledger = AllToAllLedger()
    model.hfzero_all_to_all = ledger  # what keeps it (the registered class reaches it weakly)
    EPImplementationInterface.register(_IMPLEMENTATION, _counted_all_to_all(ledger))  # instantiated right below
    apply_expert_parallelism(model, mesh.mesh["ep"], mesh.mesh["tp"], plan, ep_implementation=_IMPLEMENTATION)
    return ledger


def prepare_expert_parallel(
        model: nn.Module,
        optimizer_factory: Callable[[Iterator[nn.Parameter]], torch.optim.Optimizer] | torch.optim.Optimizer,
        config: ZeroConfig) -> tuple[nn.Module, ZeroOptimizer, ExpertMesh]:
    """Build the edp x ep mesh, split ``model``'s experts over ep and prepare ZeRO (stages 0-3): the dense
    parameters sharded over the world, the experts over edp.

    ``optimizer_factory(params)`` builds the optimizer over the expert-parallel parameters (built after the
    split, which replaces the expert parameters); an optimizer already built over the unsplit model is taken
    too (re-pointed at the new parameters, before it has stepped). Returns (model, optimizer, mesh).
    Refuses, before any collective: ep_size not dividing the world or a layer's experts, a model without an
    EP plan. Every rank reads its own batch.
    """
    from hfzero.parallel.data_parallel import prepare
    from hfzero.runtime.engine import get_engine
    from hfzero.parallel.tensor import repoint_optimizer

    plan = check_expert_parallel(model, config, initialized_world_size("expert parallelism"))
    mesh = build_ep_mesh(config.ep_size)
    before = {id(p): name for name, p in model.named_parameters()}
    ledger = apply_expert_parallel(model, mesh, plan)
    if isinstance(optimizer_factory, torch.optim.Optimizer):
        optimizer = optimizer_factory
        repoint_optimizer(optimizer, before, model)
    else:
        optimizer = optimizer_factory(model.parameters())
    model, optimizer = prepare(model, optimizer, config, process_group=mesh.edp_group, ep_group=mesh.ep_group)
    ledger.comm = get_engine(model).comm.on_group(mesh.ep_group)  # counts into the engine's statistics
    experts = sum(isinstance(p, DTensor) for p in model.parameters())
    logger.info("expert parallelism: edp=%d x ep=%d, %d expert parameter(s) split over ep; ZeRO stage %s shards the "
                "dense parameters over the world of %d and the experts over edp", mesh.edp_size, mesh.ep_size, experts,
                config.stage, mesh.edp_size * mesh.ep_size)
    return model, optimizer, mesh
