"""Reference training loops shared by parity tests, memory tests and benchmarks.

``train_zero`` runs a ZeRO configuration on the calling rank; ``train_reference`` runs the same
schedule single-process on the full batch with plain torch (AdamW, clipping, LR schedule). With
equal-length sequences the mean of micro-batch mean losses equals the full-batch mean, so the two
agree up to floating-point reordering.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import hfzero
from hfzero.testing.models import micro_batches, tiny_causal_lm, token_batches
from hfzero.testing.parity import ParityReference, float64_reference


@dataclasses.dataclass(frozen=True)
class TrainSpec:
    """One training run: model kind, ZeRO options, schedule and injected faults."""

    model: str = "gpt2"
    stage: int = 2
    dtype: str = "fp32"
    accumulation: int = 1
    no_sync: bool = False
    """Run the first accumulation-1 micro-batches under ``optimizer.no_sync()``."""
    steps: int = 10
    global_batch: int = 16
    seq_len: int = 16
    lr: float = 1e-3
    max_grad_norm: float | None = 1.0
    bucket_size: int = 4096
    overflow_step: int | None = None
    """fp16: make rank 1 (or 0 at world 1) produce a non-finite loss at this step."""
    extra_config: tuple[tuple[str, Any], ...] = ()


def param_groups(model: nn.Module, weight_decay: float = 0.1) -> list[dict[str, Any]]:
    """Two groups, as HF Trainer builds them: decay for matrices, none for vectors."""
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def _schedule(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1.0 + 0.1 * step))


def train_reference(spec: TrainSpec) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Single-process, full-batch fp32 training: per-step losses and final parameters."""
    return reference_run(tiny_causal_lm(spec.model), spec)


def train_reference64(spec: TrainSpec, run_splits: Sequence[int]) -> ParityReference:
    """``train_reference`` in float64, with the rounding bounds the fp32 runs of it stay within that split each
    global batch into ``m`` micro-batches (ranks x accumulation) for each ``m`` in ``run_splits``: the splits
    those runs use, each sampled; see [Note: Adam rounding bound] in hfzero/testing/parity.py."""
    return float64_reference(tiny_causal_lm(spec.model),
                             lambda model: torch.optim.AdamW(param_groups(model), lr=spec.lr),
                             list(token_batches(spec.steps, spec.global_batch, spec.seq_len)), spec.max_grad_norm,
                             _schedule, run_splits=run_splits)


def reference_run(model: nn.Module, spec: Any) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Train ``model`` single-process on the full batches of ``spec`` (its steps, global_batch, seq_len,
    lr, max_grad_norm): per-step losses and final parameters. AdamW steps with the fused CPU kernel, the
    implementation a CPU engine's shards step with (runtime/host_step.py), so the two agree bit for bit in
    the update itself; the for-loop one differs from it in the last bits."""
    optimizer = torch.optim.AdamW(param_groups(model), lr=spec.lr, fused=True)
    scheduler = _schedule(optimizer)
    losses = []
    for batch in token_batches(spec.steps, spec.global_batch, spec.seq_len):
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        if spec.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), spec.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def train_zero(rank: int, world_size: int, spec: TrainSpec) -> dict[str, Any]:
    """Train ``spec`` with hfzero on this rank; return losses, final parameters, memory, comm per step."""
    model = tiny_causal_lm(spec.model)
    config = hfzero.ZeroConfig(stage=spec.stage, dtype=spec.dtype, reduce_bucket_size=spec.bucket_size,
                               **dict(spec.extra_config))
    model, optimizer = hfzero.prepare(model, torch.optim.AdamW(param_groups(model), lr=spec.lr), config)
    engine = hfzero.get_engine(model)
    scheduler = _schedule(optimizer)
    losses, skipped, peak_states, comm_steps, node_bytes = [], [], 0, [], []
    for step, batch in enumerate(token_batches(spec.steps, spec.global_batch, spec.seq_len)):
        before = engine.comm.stats()
        total = torch.zeros(())
        micro = micro_batches(batch, rank, world_size, spec.accumulation)
        for index, mb in enumerate(micro):
            loss = model(input_ids=mb, labels=mb).loss.float() / spec.accumulation
            if spec.overflow_step == step and rank == min(1, world_size - 1):
                loss = loss * float("inf")
            total += loss.detach()
            if spec.no_sync and index < len(micro) - 1:
                with optimizer.no_sync():
                    optimizer.backward(loss)
            else:
                optimizer.backward(loss)
            peak_states = max(peak_states, engine.model_state_bytes())  # what is held across micro-batches
        if spec.max_grad_norm is not None:
            optimizer.clip_grad_norm_(spec.max_grad_norm)
        peak_states = max(peak_states, engine.model_state_bytes())
        optimizer.step()
        peak_states = max(peak_states, engine.model_state_bytes())
        skipped.append(optimizer.last_step_skipped)
        scheduler.step()
        after = engine.comm.stats()
        moved = {k: after[k].elements - (before[k].elements if k in before else 0) for k in after}
        comm_steps.append({k: v for k, v in moved.items() if v})
        node_bytes.append({k: [after[k].intra_node_bytes - (before[k].intra_node_bytes if k in before else 0),
                               after[k].inter_node_bytes - (before[k].inter_node_bytes if k in before else 0)]
                           for k in after if moved[k]})
        if world_size > 1:
            dist.all_reduce(total)
            total /= world_size
        losses.append(total.item())
    return {
        "losses": losses,
        "params": _full_params(model, engine),
        "skipped": skipped,
        "loss_scale": optimizer.loss_scale,
        "peak_model_state_bytes": peak_states,
        "roles": {k.value: v for k, v in engine.memory_by_role().items()},
        "comm_per_step": comm_steps,
        "node_bytes_per_step": node_bytes,  # per step and kind: [intra, inter] bytes (See [Note: node traffic])
        "num_params": engine.num_params,
        "accumulation_policy": engine.accumulation,
        "num_params_padded": engine.num_params_padded,
        "shard_numel": engine.layout.shard_numel,
        "buckets": len(engine.layout.buckets),
    }


def _full_params(model: nn.Module, engine: hfzero.ZeroEngine) -> dict[str, torch.Tensor]:
    """Every parameter, whole, as fp32 (stage 3 gathers the partitioned ones)."""
    if engine.stage < 3:
        return {n: p.detach().float().clone() for n, p in model.named_parameters()}
    full = hfzero.full_state_dict(model, rank0_only=False)
    return {n: full[n].float() for n, _ in model.named_parameters()}


def train_many(rank: int, world_size: int, specs: list[TrainSpec]) -> list[dict[str, Any]]:
    """Run several specs in one spawned process group (spawning is the expensive part)."""
    return [train_zero(rank, world_size, spec) for spec in specs]
