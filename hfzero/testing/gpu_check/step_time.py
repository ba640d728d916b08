"""Section: step time at world 1 (nothing is communicated, so this is each system's own overhead), each
system **in a process of its own** (``run_distributed`` at world 1: NCCL on CUDA, gloo on CPU), one after
another with nothing else running (the runner runs this section alone). A system that crashes loses its
own row only; the row records the error.

Systems, on the same GPT-2 (hidden 768, 12 layers, vocab 50257, batch 8 x 512 on CUDA; --quick: a tiny
one on the CPU), every step ``forward, backward, clip_grad_norm_(1.0), step, zero_grad`` (the Trainer's
default clipping):

- ``plain``: the model in 16-bit (bf16) with AdamW over it: no fp32 master copy, the cheapest step;
- ``trainer_recipe``: what ``Trainer(bf16=True)`` does, the fair baseline: fp32 weights, forward and loss
  under ``torch.autocast(dtype=bfloat16)``, fused AdamW (``adamw_torch_fused``);
- ``fsdp2``: ``fully_shard`` as its documentation recommends: ``MixedPrecisionPolicy(param_dtype=bfloat16,
  reduce_dtype=float32)``, each decoder block sharded first and the root last, ``reshard_after_forward=True``
  on the blocks (the root keeps its parameters for the backward, FSDP2's default for the root), explicit
  prefetch (each block's forward prefetches the next block's all-gather, each block's backward the one
  before), fused AdamW over the fp32 sharded parameters;
- ``zero0``..``zero3``: ``hfzero.prepare`` with ``ZeroConfig(stage=s, dtype="bf16")`` (bf16 weights, fp32
  masters) and fused AdamW.

Median of the timed steps after warm-up; on CUDA each step ends with ``torch.cuda.synchronize()``. Also
each system's CUDA peak allocated. A figure, not a threshold: the checks are that every system ran.
"""

from __future__ import annotations

import contextlib
import itertools
import statistics
import time
from typing import Any

import torch

from hfzero.testing import WorkerFailure, run_distributed
from hfzero.testing.gpu_check.common import Checks, Options

SYSTEMS = ("plain", "trainer_recipe", "fsdp2", "zero0", "zero1", "zero2", "zero3")
CLIP = 1.0


def _fsdp2(model: torch.nn.Module, dtype: torch.dtype | None) -> None:
    """Shard ``model`` with FSDP2 as its documentation recommends (see the module docstring)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    blocks = list(model.transformer.h)
    for block in blocks:
        fully_shard(block, mp_policy=policy, reshard_after_forward=True)
    fully_shard(model, mp_policy=policy)
    for current, following in itertools.pairwise(blocks):
        current.set_modules_to_forward_prefetch([following])
        following.set_modules_to_backward_prefetch([current])


def _build(system: str, size: dict[str, int], device: str, dtype: str) -> tuple[Any, Any, Any, Any]:
    """(model, optimizer, hfzero's optimizer or None, the forward's autocast context factory)."""
    import hfzero
    from hfzero.testing.models import tiny_causal_lm
    from hfzero.testing.workloads import param_groups

    model = tiny_causal_lm("gpt2", **size).to(device)
    torch_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    fused = {"fused": True}
    plain_forward = contextlib.nullcontext
    if system == "plain":
        model.to(torch_dtype)
        return model, torch.optim.AdamW(param_groups(model), lr=1e-4), None, plain_forward
    if system == "trainer_recipe":
        def autocast() -> torch.autocast:
            return torch.autocast(device_type=device, dtype=torch.bfloat16)

        return model, torch.optim.AdamW(param_groups(model), lr=1e-4, **fused), None, autocast
    if system == "fsdp2":
        _fsdp2(model, torch_dtype)
        return model, torch.optim.AdamW(param_groups(model), lr=1e-4, **fused), None, plain_forward
    config = hfzero.ZeroConfig(stage=int(system[-1]), dtype=dtype)
    model, optimizer = hfzero.prepare(model, torch.optim.AdamW(param_groups(model), lr=1e-4, **fused), config)
    return model, optimizer, optimizer, plain_forward


def time_system(rank: int, world: int, system: str, size: dict[str, int], device: str, dtype: str, batch: int,
                seq: int, warmup: int, timed: int) -> dict[str, Any]:
    """Median step seconds of ``system`` in this process (a ``run_distributed`` target)."""
    if device == "cuda":
        torch.cuda.set_device(0)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, size["vocab"], (batch, seq), generator=g).to(device)  # (B, T)
    model, optimizer, zero, forward = _build(system, size, device, dtype)
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    seconds = []
    for step in range(warmup + timed):
        started = time.perf_counter()
        with forward():
            loss = model(input_ids=tokens, labels=tokens).loss
        if zero is not None:
            zero.backward(loss)
            zero.clip_grad_norm_(CLIP)
        else:
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        optimizer.zero_grad()
        if device == "cuda":
            torch.cuda.synchronize()
        if step >= warmup:
            seconds.append(time.perf_counter() - started)
    out = {"median_s": statistics.median(seconds), "min_s": min(seconds), "loss": float(loss.detach())}
    if device == "cuda":
        out["peak_allocated"] = torch.cuda.max_memory_allocated()
    return out


def run(options: Options, checks: Checks) -> dict[str, Any]:
    if options.quick:
        size, dtype, batch, seq, warmup, timed = {"hidden": 32, "layers": 2, "vocab": 128}, "bf16", 4, 16, 1, 2
    else:
        size, dtype, batch, seq, warmup, timed = {"hidden": 768, "layers": 12, "vocab": 50257, "positions": 512}, \
            "bf16", 8, 512, 5, 20
    backend = "nccl" if options.device == "cuda" else "gloo"
    rows: dict[str, dict[str, Any]] = {}
    for system in SYSTEMS:
        try:
            row = run_distributed(time_system, 1, system, size, options.device, dtype, batch, seq, warmup, timed,
                                  backend=backend, timeout=400 if options.quick else 60)[0]
        except WorkerFailure as error:  # its own row only
            row = {"error": str(error)[-3000:]}
        rows[system] = checks.figure(system, row)
        checks.add(f"{system} ran", "error" not in row, row.get("error") or f"{1e3 * row['median_s']:.2f} ms")
    table: dict[str, dict[str, Any]] = {}
    for system, row in rows.items():
        if "error" in row:
            table[system] = {"error": row["error"].strip().splitlines()[-1][:200]}
            continue
        table[system] = {"ms": round(1e3 * row["median_s"], 2)}
        for base in ("plain", "trainer_recipe"):
            if "median_s" in rows.get(base, {}):
                table[system][f"vs_{base}"] = round(row["median_s"] / rows[base]["median_s"], 3)
        if "peak_allocated" in row:
            table[system]["peak_allocated_gib"] = round(row["peak_allocated"] / 2**30, 2)
    return {"summary": {"model": size, "dtype": dtype, "batch": [batch, seq], "timed_steps": timed,
                        "median": table}, "rows": rows}
