"""Offload cases shared by the CPU and CUDA offload tests: one run with the optimizer offloaded (or not),
returning what parity and placement checks compare.

On a CPU device the offload path runs only when forced (``FORCE_ENV``, testing only): there is nothing to
offload there, but the copies, their ordering and the host accumulation are the same code.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from typing import Any

import torch

import hfzero
from hfzero.runtime.offload import FORCE_ENV
from hfzero.runtime.streams import pinned_nbytes
from hfzero.testing.models import micro_batches, tiny_causal_lm, token_batches
from hfzero.testing.workloads import param_groups


@dataclasses.dataclass(frozen=True)
class OffloadCase:
    """One run: stage, micro-batches per step and policy, dtype, offloaded or not, optimizer options."""

    stage: int
    accumulation: int = 1
    policy: str = "sharded"
    dtype: str = "fp32"
    offload: bool = False
    fused: bool | None = None
    """AdamW's ``fused`` as the user passes it (None: default; False keeps the host step on foreach)."""
    overflow_step: int | None = None
    """fp16: rank 1 (or 0 alone) makes its loss infinite at this step."""
    steps: int = 3
    max_grad_norm: float = 0.05
    """Small enough that clipping scales every step's gradients."""

    def plain(self) -> "OffloadCase":
        """The same run without offload, with the same optimizer implementation (a CPU engine steps on the
        host too: fused by default, foreach with ``fused=False``; see runtime/host_step.py)."""
        return dataclasses.replace(self, offload=False)


def train_case(rank: int, world_size: int, case: OffloadCase, device: str = "cpu") -> dict[str, Any]:
    """Train ``case`` on this rank; losses, clip norms, skipped steps, final full parameters, placement."""
    os.environ[FORCE_ENV] = "1" if case.offload and device == "cpu" else "0"
    model = tiny_causal_lm("gpt2").to(device)
    extra = {"param_persistence_threshold": 0} if case.stage == 3 else {}
    config = hfzero.ZeroConfig(stage=case.stage, dtype=case.dtype, reduce_bucket_size=4096, accumulation=case.policy,
                               offload_optimizer=case.offload, **extra)
    options = {} if case.fused is None else {"fused": case.fused}
    model, optimizer = hfzero.prepare(model, torch.optim.AdamW(param_groups(model), lr=1e-3, **options), config)
    engine = hfzero.get_engine(model)
    early = _count_early_pushes(engine)
    losses, norms, skipped = [], [], []
    for step, batch in enumerate(token_batches(case.steps, 8, 16)):
        micro = micro_batches(batch.to(device), rank, world_size, case.accumulation)
        for index, mb in enumerate(micro):
            loss = model(input_ids=mb, labels=mb).loss.float() / case.accumulation
            if case.overflow_step == step and rank == min(1, world_size - 1):
                loss = loss * float("inf")
            deferred = optimizer.no_sync() if index < len(micro) - 1 else contextlib.nullcontext()
            with deferred:
                optimizer.backward(loss)
            losses.append(loss.item())
        norms.append(float(optimizer.clip_grad_norm_(case.max_grad_norm)))
        optimizer.step()
        skipped.append(optimizer.last_step_skipped)
        optimizer.zero_grad()
    full = hfzero.full_state_dict(model, rank0_only=False) if case.stage == 3 else None
    params = {n: (full[n] if full is not None else p.detach()).float().cpu().clone() for n, p in model.named_parameters()}
    offload = engine.offload
    inner_states = [v for s in optimizer.inner.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return {
        "losses": losses, "norms": norms, "skipped": skipped, "params": params,
        "offloaded": offload is not None,
        "pushed": offload.pushed if offload is not None else 0,
        "early_pushes": early[0],
        "device_grad_shard": engine.reducer.grad_shard is not None,
        "host_roles": {k.value: v for k, v in engine.host_memory_by_role().items()},
        "fused": [g.get("fused") for g in optimizer.inner.param_groups],
        "pinned": {
            "master": bool(engine.master_flat is not None and engine.master_flat.is_pinned()),
            "grad": bool(offload is not None and offload.grad.is_pinned()),
            "staging": bool(offload is not None and offload.staging.is_pinned()),
            "states": any(v.is_pinned() for v in inner_states),
        },
        "pin_plan": dict(offload.pin_plan) if offload is not None else {},
        "pinned_bytes": offload.pinned_bytes() if offload is not None else 0,
        "expected_pinned_bytes": _expected_pinned_bytes(engine),
        "step_threads": offload.step_threads if offload is not None else None,
        "copy_stream": offload is not None and offload.copy_stream is not None,
    }


def _expected_pinned_bytes(engine: hfzero.ZeroEngine) -> int:
    """What the offload should page-lock: staging, plus the master when parameters are fp32, each at its
    exact size rounded to the page (see [Note: exact-size pinned memory]); 0 off CUDA."""
    offload = engine.offload
    if offload is None or not offload.pinned:
        return 0
    sizes = [offload.staging] + ([engine.master_flat] if engine.policy.param_dtype == torch.float32 else [])
    return sum(pinned_nbytes(t.numel(), t.dtype) for t in sizes)


def _count_early_pushes(engine: hfzero.ZeroEngine) -> list[int]:
    """Count gradient copies issued while backward still had gradients to compute (overlap with backward):
    pushes made before every parameter of the pass had received its gradient."""
    early = [0]
    if engine.offload is None:
        return early
    push, total = engine.offload.push, len(engine.layout.slots)

    def counting(bucket, reduced):
        if len(engine.reducer._fired) < total:
            early[0] += 1
        return push(bucket, reduced)

    engine.offload.push = counting
    return early


def train_cases(rank: int, world_size: int, cases: list[OffloadCase], device: str = "cpu") -> list[dict[str, Any]]:
    """Several cases in one spawned process group; ``device`` "cuda" places rank r on cuda:r."""
    if device == "cuda":
        torch.cuda.set_device(rank)
        device = f"cuda:{rank}"
    return [train_case(rank, world_size, case, device) for case in cases]
