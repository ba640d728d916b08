"""Memory of one rank of a large world, measured in one process on torch's fake process group.

``measure_rank(rank, world_size, specs)`` runs inside ``run_fake_rank`` (spawn.py): the process acts as
rank ``rank`` of ``world_size`` ranks, every collective returns at once and moves nothing, so losses and
parameters are meaningless but every tensor the engine allocates has its real size. Each spec prepares a
GPT-2 model at one stage, trains a few steps and reports, after every step, the model-state bytes the
engine holds (by role), the stage-3 gathers and how the gather pool served them and, on CUDA, the
allocator's peaks; then whether the engine was freed once dropped; with the paper's formula
(``hfzero.planning.estimate``) on Ψ and on the padded count, so callers compare without re-deriving it. Used by tests/test_fake_world_memory.py (CPU, tiny) and the GPU check (CUDA, ~350M).
"""

from __future__ import annotations

import dataclasses
import gc
import weakref
from typing import Any

import torch

import hfzero
from hfzero.planning.estimate import model_states_bytes, precision_bytes
from hfzero.roles import MODEL_STATE_ROLES, MemoryRole
from hfzero.testing.models import tiny_causal_lm
from hfzero.testing.workloads import param_groups


@dataclasses.dataclass(frozen=True)
class FakeMemorySpec:
    """One measured run.

    Attributes:
        stage: ZeRO stage (1-3).
        dtype: "fp32", "bf16" or "fp16".
        hidden, layers, vocab: the GPT-2 model's size (hidden 1024, 24 layers, vocab 50257 is ~350M).
        steps: optimizer steps (one micro-batch each).
        batch, seq_len: the micro-batch this rank trains on.
        device: "cpu" or "cuda" (cuda: the current device).
    """

    stage: int
    dtype: str = "bf16"
    hidden: int = 64
    layers: int = 2
    vocab: int = 256
    steps: int = 3
    batch: int = 1
    seq_len: int = 16
    device: str = "cpu"


def measure_rank(rank: int, world_size: int, specs: list[FakeMemorySpec]) -> list[dict[str, Any]]:
    """Run every spec on this (fake) rank; one result dict per spec (see ``measure_one``). Each spec's
    engine is dropped and collected before the next; one that is not freed carries its memory into the
    next spec's figures (``engine_freed`` says so): the GPU check runs one spec per process."""
    out = []
    for spec in specs:
        out.append(measure_one(rank, world_size, spec))
        if spec.device == "cuda":
            torch.cuda.empty_cache()
    return out


def pool_counters(engine: Any) -> tuple[int, int]:
    """(gathers served, buffers allocated) by stage 3's gather buffer pool since the engine was built: the
    two counters any pool design exposes (``engine.gather_pool.served`` and ``.allocations``), so a check
    can see that the pool served every gather after the first step, not only that it allocated nothing."""
    pool = engine.gather_pool
    return pool.served, pool.allocations


def measure_one(rank: int, world_size: int, spec: FakeMemorySpec) -> dict[str, Any]:
    """Train ``spec`` on this rank, then drop the model, optimizer and engine; returns sizes, the formula
    and per-step memory figures:

    - ``model_state_bytes``: per step, the peak over the step of the engine's model-state roles;
    - ``formula_bytes``: the paper's formula on Ψ; ``formula_padded_bytes``: on the padded count (the
      engine pads each bucket to a multiple of the world), plus Adam's fp32 ``step`` scalar per bucket;
    - stage 3, per step: ``gathers`` (units gathered, from the scheduler's trace), ``pool_served`` (gathers
      the pool gave memory), ``pool_new`` (buffers it allocated); cumulative ``pool_allocations``,
      ``pool_idle_bytes``, ``gathered_after_step``;
    - ``engine_freed``: whether the engine was garbage-collected once the caller's references were gone
      (nothing hfzero registered keeps it alive);
    - CUDA: ``cuda_peak_allocated`` / ``cuda_peak_reserved`` per step (peaks since after ``prepare``),
      ``cuda_allocated_after_step``; ``cuda_allocated_before_model`` (this process's baseline),
      ``cuda_allocated_before_prepare`` (the model's weights) and ``cuda_allocated_after_free`` (after the
      engine was dropped and collected).
    """
    cuda = spec.device == "cuda"
    if cuda:
        torch.cuda.synchronize()
    before = torch.cuda.memory_allocated() if cuda else 0
    result, engine_ref = _train(rank, world_size, spec)
    gc.collect()
    result["engine_freed"] = engine_ref() is None
    if cuda:
        torch.cuda.synchronize()
        result.update(cuda_allocated_before_model=before, cuda_allocated_after_free=torch.cuda.memory_allocated())
    return result


def _train(rank: int, world_size: int, spec: FakeMemorySpec) -> tuple[dict[str, Any], Any]:
    """``measure_one``'s training; returns its figures and a weak reference to the engine (every strong
    one this function held is gone when it returns)."""
    cuda = spec.device == "cuda"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    model = tiny_causal_lm("gpt2", hidden=spec.hidden, layers=spec.layers, vocab=spec.vocab,
                           positions=max(64, spec.seq_len)).to(device)
    extra = {"param_persistence_threshold": 0} if spec.stage == 3 else {}
    config = hfzero.ZeroConfig(stage=spec.stage, dtype=spec.dtype, **extra)
    before_prepare = torch.cuda.memory_allocated() if cuda else 0
    model, optimizer = hfzero.prepare(model, torch.optim.AdamW(param_groups(model), lr=1e-4), config)
    engine = hfzero.get_engine(model)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    g = torch.Generator().manual_seed(rank)
    result: dict[str, Any] = {"stage": spec.stage, "dtype": spec.dtype, "world": world_size, "rank": rank,
                              "num_params": engine.num_params, "num_params_padded": engine.num_params_padded,
                              "buckets": len(engine.layout.buckets), "model_state_bytes": [],
                              "pool_allocations": [], "pool_idle_bytes": [], "gathered_after_step": [],
                              "gathers": [], "pool_served": [], "pool_new": [],
                              "cuda_peak_allocated": [], "cuda_peak_reserved": [], "cuda_allocated_after_step": [],
                              "cuda_allocated_before_prepare": before_prepare}
    events = engine.trace(True) if spec.stage == 3 else None
    for _ in range(spec.steps):
        counters = pool_counters(engine) if spec.stage == 3 else None
        batch = torch.randint(0, spec.vocab, (spec.batch, spec.seq_len), generator=g).to(device)  # (B, T)
        optimizer.backward(model(input_ids=batch, labels=batch).loss)
        peak = engine.model_state_bytes()
        optimizer.step()
        peak = max(peak, engine.model_state_bytes())
        optimizer.zero_grad()
        result["model_state_bytes"].append(max(peak, engine.model_state_bytes()))
        if spec.stage == 3:
            roles = engine.memory_by_role()
            served, allocations = pool_counters(engine)
            result["gathers"].append(sum(1 for kind, _ in events if kind == "gather"))
            events.clear()
            result["pool_served"].append(served - counters[0])
            result["pool_new"].append(allocations - counters[1])
            result["pool_allocations"].append(allocations)
            result["pool_idle_bytes"].append(roles.get(MemoryRole.COMM_BUFFER, 0))
            result["gathered_after_step"].append(roles.get(MemoryRole.PARAM_GATHERED, 0))
        if cuda:
            torch.cuda.synchronize()
            result["cuda_peak_allocated"].append(torch.cuda.max_memory_allocated())
            result["cuda_peak_reserved"].append(torch.cuda.max_memory_reserved())
            result["cuda_allocated_after_step"].append(torch.cuda.memory_allocated())
    if events is not None:
        engine.trace(False)
    roles = engine.memory_by_role()
    result["roles_after_step"] = {k.value: v for k, v in roles.items()}
    result["model_state_roles_after_step"] = sum(v for k, v in roles.items() if k in MODEL_STATE_ROLES)
    p, g_, k = precision_bytes(spec.dtype, "adamw")
    result["formula_bytes"] = model_states_bytes(engine.num_params, world_size, spec.stage, param_bytes=p,
                                                 grad_bytes=g_, optimizer_k=k)
    result["formula_padded_bytes"] = model_states_bytes(engine.num_params_padded, world_size, spec.stage,
                                                        param_bytes=p, grad_bytes=g_, optimizer_k=k) \
        + 4 * len(engine.layout.buckets)
    return result, weakref.ref(engine)
