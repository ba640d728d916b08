"""The profiler's pipeline figures: the pp x dp mesh and per-stage predictions for the header, each
step's bubble and P2P figures for the step record.

Under pipeline parallelism (``hfzero.pipeline``) every rank records its own stage(s): the engine it
reads is the stage's, over the stage's dp group. What the whole run needs on top of that is where each
rank sits (pp rank, dp rank, global stages), what the cost model predicts per stage (model states by
role, dp communication, P2P bytes, the bubble), and what each stage measured of the schedule (see
[Note: measuring the bubble] in hfzero/parallel/pipeline/timeline.py). Nothing here runs a collective
but ``gather_identities`` (one small all-gather at the profiler's start).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist

from hfzero.parallel.pipeline import Pipeline
from hfzero.parallel.pipeline.cost import bubble_fraction, comm_elements, model_state_roles, p2p_bytes


def identity(pipe: Pipeline) -> dict[str, Any]:
    """This rank's place in the mesh and the size of its stage(s)."""
    return {"rank": dist.get_rank(), "pp_rank": pipe.mesh.pp_rank, "dp_rank": pipe.mesh.dp_rank,
            "stages": [s.stage_index for s in pipe.stages], "params": int(pipe.engine.num_params),
            "tied": int(pipe.tied_numel) if pipe.tied_comm is not None else 0, "shared": int(pipe.shared_numel),
            "blocks": sum(len(s.block_names) for s in pipe.stages)}


def gather_identities(pipe: Pipeline) -> list[dict[str, Any]]:
    """Every rank's ``identity`` by global rank. Collective over the world (one small all-gather)."""
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, identity(pipe))
    return out


def header_section(pipe: Pipeline, identities: list[dict[str, Any]], optimizer_kind: str | None) -> dict[str, Any]:
    """The header's ``pipeline`` object (docs/profile-format.md): the mesh, the schedule, the policy and,
    per pp rank, its ranks, stages and the cost model's figures (None where the optimizer is unknown)."""
    zero = pipe.zero_config
    pp, dp, n_micro = pipe.mesh.pp_size, pipe.mesh.dp_size, pipe.config.n_microbatches
    gather = pipe.config.stage3_gather if zero.stage == 3 else None
    ranks = []
    for pp_rank in range(pp):
        mine = sorted((i for i in identities if i["pp_rank"] == pp_rank), key=lambda i: i["dp_rank"])
        first = mine[0]
        entry: dict[str, Any] = {"pp_rank": pp_rank, "global_ranks": [i["rank"] for i in mine],
                                 "stages": first["stages"], "params": first["params"], "tied": first["tied"],
                                 "blocks": first["blocks"], "model_states_by_role": None, "model_state_bytes": None}
        if optimizer_kind is not None:
            roles = model_state_roles(first["params"], dp, zero.stage, dtype=zero.dtype, optimizer=optimizer_kind,
                                      accumulation=pipe.accumulation, stage3_gather=gather or "step")
            entry["model_states_by_role"] = {k: int(round(v)) for k, v in roles.items() if v}
            entry["model_state_bytes"] = int(round(sum(roles.values())))
        elements = comm_elements(first["params"], dp, zero.stage, n_micro, accumulation=pipe.accumulation,
                                 stage3_gather=gather or "step", tied=first["tied"], shared=first.get("shared", 0))
        entry["comm_elements_per_step"] = {k: int(round(v)) for k, v in elements.items() if v}
        ranks.append(entry)
    return {"pp": pp, "dp": dp, "schedule": pipe.kind.name, "n_micro": n_micro,
            "stages_per_rank": pipe.kind.stages_per_rank, "num_stages": pipe.num_stages,
            "zero_stage": zero.stage, "accumulation": pipe.accumulation, "stage3_gather": gather,
            "bubble_estimate": bubble_fraction(pp, n_micro, pipe.kind.stages_per_rank), "ranks": ranks}


def step_section(pipe: Pipeline) -> dict[str, Any] | None:
    """The step record's ``pipeline`` object: the last training step's clock summary plus the cost model's
    P2P bytes and bubble for its micro-batches; None before the first training step."""
    last = pipe.clock.last
    if last is None:
        return None
    out = copy.deepcopy(last)
    out["stages"] = [s.stage_index for s in pipe.stages]
    out["bubble_estimate"] = bubble_fraction(pipe.mesh.pp_size, last["n_micro"], pipe.kind.stages_per_rank)
    if last.get("micro_shape"):
        rows, seq = last["micro_shape"]
        boundary = rows * seq * pipe.hidden_size * torch.empty((), dtype=pipe.zero_config.torch_dtype).element_size()
        by_rank = [pipe.kind.stage_ids(r, pipe.mesh.pp_size) for r in range(pipe.mesh.pp_size)]
        out["p2p_estimate"] = p2p_bytes(by_rank, pipe.mesh.pp_rank, last["n_micro"], boundary)
    return out
