"""The pipeline x ZeRO cost model: per-rank model states by role, communication per step, activations
in flight, the bubble, and when per-micro-batch collectives hide behind compute on a GPU cluster.

[Note: pipeline x ZeRO costs]
Ψ_s = trainable parameters of pipeline stage s (the tied embedding counted on the first and the last
stage), N = dp size, M = micro-batches per step, p/g = parameter/gradient bytes, K = optimizer bytes
(fp32 master + states). Per rank of stage s:
- model states: stage 0 (p+g+K)Ψ_s; 1: (p+g)Ψ_s + KΨ_s/N; 2: pΨ_s + (g+K)Ψ_s/N;
  3: (p+g+K)Ψ_s/N. Policies add memory held across micro-batches (GRAD_ACCUM, a model state):
  "local" at stages 2-3 keeps a full local gradient gΨ_s for the step; stage-3 "step" gathering
  keeps the gathered parameters pΨ_s for the step (PARAM_GATHERED).
- communication elements (comm.py's convention: all-reduce of n = 2n, reduce-scatter of n = n,
  all-gather into n = n), with R = 1 reduction per step ("local") or M ("sharded"):
  stage 0: 2Ψ_s R; stages 1-2: Ψ_s R + Ψ_s (the step's all-gather); stage 3: Ψ_s R + gathers
  (Ψ_s once per step with "step" gathering, 2Ψ_s M with "micro"). The tied embedding (T elements) adds
  an all-reduce of its owned slice between the first and last stage: 2T/N (2T at stage 0).
  A dp size of 1 moves nothing within the stage.
- a rank running several stages (v per rank): Ψ_s is the sum over its stages, and each backward
  reduces only the stage it back-propagates ([Note: active buckets] in reducer.py), so "sharded" is
  still M reductions of Ψ_s. Zero-bubble schedules reduce the weight pass's gradients right after it,
  the same count. When both ends of a tied embedding run on one rank (V-shaped schedules' first pp
  rank) it is one parameter (counted once in Ψ_s, no pair all-reduce), but both stages' backwards
  produce its gradient: "sharded" reduces its T elements 2M times (M(Ψ_s + T)), "local" once.
- activations: a stage keeps the activations of the micro-batches it has run forward and not yet
  backward: M under GPipe, min(P - s, M) under 1F1B (stage 0 the most).
- bubble fraction: (P - 1) / M for GPipe and 1F1B, (P - 1) / (v M) with v stages per rank: the idle
  time over the ideal (busy) time, which the profiler measures as idle / busy per stage.
- P2P: per micro-batch, every stage boundary between two ranks carries the activation forward and its
  gradient backward (rows x seq x hidden elements each way), see ``p2p_bytes``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from hfzero.planning.estimate import precision_bytes

ROLE_NAMES = ("param_full", "param_shard", "param_gathered", "grad_full", "grad_shard", "grad_accum",
              "master_shard", "optim_state")


@dataclasses.dataclass(frozen=True)
class StageShape:
    """Attributes: params (Ψ_s, trainable, tied copy included), tied (elements of the tied embedding
    this stage holds, 0 if none or with one stage in all), blocks (decoder blocks)."""

    params: int
    tied: int
    blocks: int


def stage_shapes(model: Any, pp: int, layers_per_stage: Any = None, stages_per_rank: int = 1) -> list[StageShape]:
    """Per-stage shapes of a HF model (a meta model is enough): the split hfzero.pipeline makes."""
    from hfzero.parallel.pipeline.split import plan_stages, split_model, tied_embeddings

    stages = pp * stages_per_rank
    plan = plan_stages(model, stages, layers_per_stage)
    tied = tied_embeddings(model) and pp > 1
    shapes = []
    for stage in split_model(model, range(stages), stages, layers_per_stage):
        params = sum(p.numel() for p in stage.parameters() if p.requires_grad)
        held = stage.get_parameter(stage.tied_name).numel() if tied and stage.tied_name else 0
        shapes.append(StageShape(params, held, len(plan[stage.stage_index])))
    return shapes


def model_state_roles(params: float, dp: int, stage: int, *, dtype: str = "bf16", optimizer: str = "adam",
                      accumulation: str = "local", stage3_gather: str = "step") -> dict[str, float]:
    """Bytes per role held by one rank of a stage with ``params`` parameters; see [Note: pipeline x ZeRO costs]."""
    p, g, k = precision_bytes(dtype, optimizer)
    master = 4 if p < 4 else 0
    shard_os = params / dp if stage >= 1 else params
    roles = {name: 0.0 for name in ROLE_NAMES}
    if stage == 3:
        roles["param_shard"] = p * params / dp
        roles["param_gathered"] = p * params if stage3_gather == "step" else 0.0
    else:
        roles["param_full"] = p * params
    if stage >= 2:
        roles["grad_shard"] = g * params / dp
        roles["grad_accum"] = g * params if accumulation == "local" else 0.0
    else:
        roles["grad_full"] = g * params
    roles["master_shard"] = master * shard_os
    roles["optim_state"] = (k - master) * shard_os
    return roles


def rank_params(shapes: list[StageShape], stage_ids: list[int]) -> tuple[int, int, int]:
    """(params, tied, shared) of the rank running ``stage_ids``: its parameters counted once, the tied
    embedding's elements summed with a peer rank (0 when both ends run here), and the elements of the
    parameter two of its stages hold (the tied embedding with both ends here, else 0)."""
    mine = [shapes[i] for i in stage_ids]
    holders = [s.tied for s in mine if s.tied]
    params = sum(s.params for s in mine)
    if len(holders) > 1:
        return params - holders[0], 0, holders[0]
    return params, sum(holders), 0


def comm_elements(params: float, dp: int, stage: int, n_micro: int, *, accumulation: str = "local",
                  stage3_gather: str = "step", tied: float = 0, shared: float = 0) -> dict[str, float]:
    """Elements per step per rank by collective kind; see [Note: pipeline x ZeRO costs]. ``params`` counts
    every parameter once; ``shared``: elements of one held by two of the rank's stages (``rank_params``)."""
    reduced = params if accumulation == "local" else (params + shared) * n_micro
    out = {"all_reduce": 0.0, "reduce_scatter": 0.0, "all_gather": 0.0}
    if dp > 1:
        if stage == 0:
            out["all_reduce"] += 2 * reduced
        else:
            out["reduce_scatter"] += reduced
            if stage < 3:
                out["all_gather"] += params
            else:
                out["all_gather"] += params if stage3_gather == "step" else 2 * params * n_micro
    if tied:
        out["all_reduce"] += 2 * tied / (1 if stage == 0 else dp)
    return out


def activation_in_flight(schedule: str, pp: int, stage_index: int, n_micro: int) -> int:
    """Micro-batches whose activations a stage holds at its peak."""
    name = schedule.lower()
    if name == "gpipe":
        return n_micro
    if name == "1f1b":
        return min(pp - stage_index, n_micro)
    return n_micro  # multi-stage schedules: bounded by M (their warm-up depth depends on the schedule)


def p2p_bytes(stage_ids_by_rank: list[list[int]], pp_rank: int, n_micro: int, activation_bytes: int) -> dict[str, int]:
    """Bytes pp rank ``pp_rank`` sends and receives by P2P in one training step.

    Every stage boundary between two different ranks carries, per micro-batch, the activation forward
    and its gradient backward, each ``activation_bytes`` (rows x seq x hidden x element size): a stage
    sends its output to the next stage and its input's gradient to the previous one, and receives the
    mirror images. Boundaries between two stages of the same rank (V-shaped schedules) move nothing.
    ``stage_ids_by_rank[r]`` lists the global stages of pp rank r.
    """
    holder = {stage: rank for rank, ids in enumerate(stage_ids_by_rank) for stage in ids}
    remote = sum(1 for stage in stage_ids_by_rank[pp_rank] for peer in (stage - 1, stage + 1)
                 if peer in holder and holder[peer] != pp_rank)
    return {"send": remote * n_micro * activation_bytes, "recv": remote * n_micro * activation_bytes}


def bubble_fraction(pp: int, n_micro: int, stages_per_rank: int = 1) -> float:
    """Idle fraction of the ideal step: (P - 1) / (v M)."""
    return (pp - 1) / (stages_per_rank * n_micro)


def overlap_min_tokens(hidden: int, seq_len: int, dp: int, link_bytes_per_s: float, flops: float,
                       grad_bytes: int = 2) -> float:
    """Tokens per micro-batch above which a stage's per-micro-batch reduce-scatter of its gradients
    (ring: g Ψ (N-1)/N bytes per rank) takes no longer than the micro-batch's backward compute.

    Per layer: 12h² parameters; backward FLOPs per token 2/3 of the fwd+bwd total
    72h² + 12 s h (Narayanan et al. 2021, without recomputation), i.e. 48h² + 8sh. So the ratio
    comm/compute = g 12h² (N-1)/N / B  /  (t (48h² + 8sh) / F), and it is <= 1 when
    t >= g 12h² (N-1)/N F / (B (48h² + 8sh)). The same bound holds for a per-micro-batch
    all-gather of the parameters (p = g bytes) against the forward (half the backward: twice the tokens).
    """
    per_param = grad_bytes * 12 * hidden**2 * (dp - 1) / dp
    return per_param * flops / (link_bytes_per_s * (48 * hidden**2 + 8 * seq_len * hidden))


def node_split(comm: dict[str, float], pp_rank: int, dp: int, per_node: int, *, shard_size: int = 0,
               replicated: float = 0, tied: float = 0, stage: int = 0, tied_peer: int | None = None,
               node_local: float = 0) -> float:
    """Inter-node elements per step of pp rank ``pp_rank``'s ZeRO traffic ``comm`` (``comm_elements``, shard
    group G = ``shard_size`` or dp, plus under HSDP the all-reduce of the ``replicated`` elements' shard over the
    replicas), for the pp x dp world on nodes of
    ``per_node`` consecutive ranks (``rank = pp_rank * dp + dp_rank``), as hfzero/comm/collectives.py counts it ([Note: node
    traffic]): each collective's elements times its ring's crossing hops over its ranks, for dp rank 0's groups.
    The tied-embedding all-reduce (``tied`` elements, counted in ``comm["all_reduce"]``) runs over the pair
    (this stage's rank, pp rank ``tied_peer``'s) of the same dp index. ``node_local``: elements of the gathers
    that hpZ's secondary partition keeps inside the node (the backward gathers)."""
    from hfzero.comm.topology import ring_crossings

    shard = shard_size or dp
    base = pp_rank * dp
    tied_part = 2 * tied / (1 if stage == 0 else shard) if tied and tied_peer is not None else 0.0
    replicate_part = 2.0 * replicated / shard if shard < dp else 0.0
    zero = sum(comm.values()) - tied_part - replicate_part - node_local
    inter = zero * ring_crossings(range(base, base + shard), per_node) / shard
    if replicate_part:
        replicas = list(range(base, base + dp, shard))
        inter += replicate_part * ring_crossings(replicas, per_node) / len(replicas)
    if tied_part:
        inter += tied_part * ring_crossings([base, tied_peer * dp], per_node) / 2
    return inter


def group_nodes(group: range, per_node: int) -> tuple[int, int]:
    """(L, N): a group's ranks per node and nodes spanned; a ValueError when nodes hold different numbers of them
    (qgZ's hops need equal parts)."""
    from hfzero.comm.topology import node_of

    by_node: dict[int, int] = {}
    for rank in group:
        by_node[node_of(rank, per_node)] = by_node.get(node_of(rank, per_node), 0) + 1
    if len(set(by_node.values())) != 1:
        raise ValueError(f"quantized gradients need every node to hold as many of a shard group's ranks; "
                         f"{len(group)} ranks on nodes of {per_node} do not")
    return len(group) // len(by_node), len(by_node)


def node_bytes(comm: dict[str, float], pp_rank: int, dp: int, per_node: int, *, element_bytes: float,
               shard_size: int = 0, replicated: float = 0, tied: float = 0, stage: int = 0,
               tied_peer: int | None = None, node_local: float = 0, quantize_weights: str | None = None,
               quantize_gradients: str | None = None, quantize_block: int = 256) -> tuple[float, float]:
    """(total, inter-node) bytes per step of pp rank ``pp_rank``'s ZeRO traffic ``comm`` (``node_split``'s
    arguments; unquantized elements cost ``element_bytes``, parameters and gradients alike). qwZ packs every
    parameter gather but hpZ's ``node_local`` backward gathers; qgZ replaces each reduction of n elements over the
    shard group (L of its ranks per node, N nodes; See [Note: quantized collectives] in hfzero/comm/quantized.py) by
    an all-to-all of n packed values inside the node (when L > 1) and one of n / L across nodes (when N > 1), so the
    M reductions of "sharded" accumulation cross with n / L packed values each instead of the ring's share of n.
    Packed values cost ``bits / 8 + 4 / block`` bytes (``estimate_quantized.packed_bytes_per_element``: no padding
    of each chunk to whole blocks, exact when the chunks are whole blocks). The tied-embedding sum and HSDP's
    replicate all-reduce stay unquantized. Stage 0 is never quantized."""
    from hfzero.planning.quantized import packed_bytes_per_element
    from hfzero.comm.topology import ring_crossings

    shard = shard_size or dp
    plain = dict(comm)
    total = inter = 0.0
    group = range(pp_rank * dp, pp_rank * dp + shard)  # dp rank 0's shard group
    if stage and shard > 1 and quantize_gradients:
        local, nodes = group_nodes(group, per_node)
        wire = packed_bytes_per_element(quantize_gradients, quantize_block, element_bytes)
        reduced, plain["reduce_scatter"] = plain["reduce_scatter"], 0.0
        crossing = reduced / local * wire if nodes > 1 else 0.0
        total += (reduced * wire if local > 1 else 0.0) + crossing
        inter += crossing
    if stage and shard > 1 and quantize_weights:
        wire = packed_bytes_per_element(quantize_weights, quantize_block, element_bytes)
        gathered, plain["all_gather"] = plain["all_gather"] - node_local, node_local
        total += gathered * wire
        inter += gathered * wire * ring_crossings(group, per_node) / shard
    total += sum(plain.values()) * element_bytes
    inter += element_bytes * node_split(plain, pp_rank, dp, per_node, shard_size=shard, replicated=replicated,
                                        tied=tied, stage=stage, tied_peer=tied_peer, node_local=node_local)
    return total, inter


def estimate_pipeline(shapes: list[StageShape], *, pp: int, dp: int, stage: int, n_micro: int,
                      schedule: str = "1F1B", dtype: str = "bf16", optimizer: str = "adam",
                      accumulation: str = "auto", stage3_gather: str = "step",
                      stages_per_rank: int = 1, shard_size: int = 0, ranks_per_node: int = 0,
                      secondary_partition: bool = False, quantize_weights: str | None = None,
                      quantize_gradients: str | None = None, quantize_block: int = 256,
                      quantize_error_feedback: bool = False) -> dict[str, Any]:
    """Per-rank figures for every pp rank (its stages summed), as ``hfzero estimate --pp`` prints them.
    ``shard_size`` G (HSDP inside each stage): ZeRO over G of the stage's dp ranks, the gradient shard all-reduced
    over the dp / G replicas once per step. ``ranks_per_node`` (0: one node) adds each rank's inter-node elements
    (``node_split``); ``secondary_partition`` (hpZ, stage 3 gathering per micro-batch) keeps the backward gathers,
    Ψ_s per micro-batch, inside the node (with ``stage3_gather="step"`` the backward gathers nothing).
    ``quantize_weights`` / ``quantize_gradients`` (qwZ / qgZ, stages 1-3): bytes per step change, not elements;
    every rank's ``comm_bytes_per_step`` and ``inter_node_bytes_per_step`` count them (``node_bytes``);
    ``quantize_error_feedback`` adds the role ``quant_residual`` (fp32: Ψ_s for the intra-node hop when L > 1, Ψ_s / L
    for the inter-node hop when N > 1) to the model states."""
    from hfzero.parallel.pipeline.schedule import resolve_schedule

    shard = shard_size or dp
    if shard < 1 or dp % shard:
        raise ValueError(f"shard_size={shard_size} must divide dp={dp}")
    world = pp * dp
    per_node = ranks_per_node or world
    if world % per_node:
        raise ValueError(f"ranks_per_node={ranks_per_node} must divide the world pp x dp = {world}")

    policy = accumulation if accumulation != "auto" else ("sharded" if stage >= 2 else "local")
    kind = resolve_schedule(schedule)
    ranks = []
    for pp_rank in range(pp):
        ids = _ids(kind, pp_rank, pp, stages_per_rank)
        mine = [shapes[i] for i in ids]
        params, tied, shared = rank_params(shapes, ids)
        roles = model_state_roles(params, shard, stage, dtype=dtype, optimizer=optimizer, accumulation=policy,
                                  stage3_gather=stage3_gather)
        if quantize_error_feedback and quantize_gradients and stage and shard > 1:
            local, nodes = group_nodes(range(pp_rank * dp, pp_rank * dp + shard), per_node)
            roles["quant_residual"] = 4.0 * ((params if local > 1 else 0.0) + (params / local if nodes > 1 else 0.0))
        comm = comm_elements(params, shard, stage, n_micro, accumulation=policy, stage3_gather=stage3_gather,
                             tied=tied, shared=shared)
        if shard < dp:  # HSDP: the gradient shard's all-reduce over the replicas
            comm["all_reduce"] += 2.0 * params / shard
        peers = [r for r in range(pp) if r != pp_rank and rank_params(shapes, _ids(kind, r, pp, stages_per_rank))[1]]
        node_local = params * n_micro if secondary_partition and stage == 3 and stage3_gather == "micro" else 0.0
        ranks.append({
            "pp_rank": pp_rank, "params": params, "blocks": sum(s.blocks for s in mine),
            "model_states_by_role": roles, "model_states_bytes": sum(roles.values()),
            "comm_elements_per_step": comm,
            "inter_node_elements_per_step": node_split(comm, pp_rank, dp, per_node, shard_size=shard,
                                                       replicated=params if shard < dp else 0.0, tied=tied,
                                                       stage=stage, node_local=node_local,
                                                       tied_peer=peers[0] if tied and peers else None),
            "microbatches_in_flight": activation_in_flight(schedule, pp, pp_rank, n_micro),
        })
        ranks[-1]["comm_bytes_per_step"], ranks[-1]["inter_node_bytes_per_step"] = node_bytes(
            comm, pp_rank, dp, per_node, element_bytes=precision_bytes(dtype, optimizer).grad_bytes, shard_size=shard,
            replicated=params if shard < dp else 0.0, tied=tied, stage=stage, node_local=node_local,
            tied_peer=peers[0] if tied and peers else None, quantize_weights=quantize_weights,
            quantize_gradients=quantize_gradients, quantize_block=quantize_block)
    return {"pp": pp, "dp": dp, "shard_size": shard, "ranks_per_node": per_node, "stage": stage, "n_micro": n_micro,
            "schedule": schedule, "dtype": dtype, "quantize_weights": quantize_weights,
            "quantize_gradients": quantize_gradients, "quantize_block": quantize_block,
            "optimizer": optimizer, "accumulation": policy, "stage3_gather": stage3_gather,
            "bubble_fraction": bubble_fraction(pp, n_micro, stages_per_rank), "ranks": ranks}


def _ids(kind: Any, pp_rank: int, pp: int, stages_per_rank: int) -> list[int]:
    """The global stages of pp rank ``pp_rank`` (the schedule's placement, or round-robin)."""
    return (kind.stage_ids(pp_rank, pp) if kind.stages_per_rank == stages_per_rank
            else [pp_rank + k * pp for k in range(stages_per_rank)])

