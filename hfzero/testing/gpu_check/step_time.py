"""Section: step time at world 1 (nothing is communicated, so this is the engine's own overhead): hfzero
stages 0-3 against two plain AdamW loops and FSDP2 (``fully_shard`` per block and the root) on the same GPT-2
(hidden 768, 12 layers, bf16, batch 8 x 512 on CUDA; --quick: a tiny fp32 one on the CPU). ``plain``: the model
in the run's dtype with AdamW over it (no fp32 master copy: the cheapest step); ``plain_amp``: the Trainer's
recipe and the fair baseline (fp32 weights under ``torch.autocast`` in the run's dtype, fused AdamW); FSDP2 and
hfzero keep fp32 masters with 16-bit compute (hfzero's inner AdamW steps fused on an accelerator,
runtime/host_step.py). Every system is built first, warmed up, then timed in interleaved rounds (each round
runs every system's steps in turn, the order rotated), so drift over the run (clocks, temperature, the
allocator) hits them alike; on CUDA each step ends with ``torch.cuda.synchronize()``. Medians of the timed
steps, and each system's median over plain's and plain_amp's. A figure, not a threshold: the check is that
every system ran."""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

import hfzero
from hfzero.testing.gpu_check.common import Checks, Options, in_process_group
from hfzero.testing.models import tiny_causal_lm
from hfzero.testing.workloads import param_groups

SYSTEMS = ("plain", "plain_amp", "fsdp2", "zero0", "zero1", "zero2", "zero3")


def _build(system: str, size: dict[str, int], device: str, dtype: str):
    model = tiny_causal_lm("gpt2", **size).to(device)
    torch_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    if system == "plain":
        model.to(torch_dtype)
        return model, torch.optim.AdamW(param_groups(model), lr=1e-4), None
    if system == "plain_amp":
        fused = {"fused": True} if device == "cuda" else {}
        return model, torch.optim.AdamW(param_groups(model), lr=1e-4, **fused), torch_dtype
    if system == "fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        policy = MixedPrecisionPolicy(param_dtype=torch_dtype, reduce_dtype=torch_dtype)
        for block in model.transformer.h:
            fully_shard(block, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        return model, torch.optim.AdamW(param_groups(model), lr=1e-4), None
    config = hfzero.ZeroConfig(stage=int(system[-1]), dtype=dtype)
    model, optimizer = hfzero.prepare(model, torch.optim.AdamW(param_groups(model), lr=1e-4), config)
    return model, optimizer, optimizer


def time_rank(rank: int, world: int, size: dict[str, int], device: str, dtype: str, batch: int, seq: int,
              warmup: int, timed: int, rounds: int = 5) -> dict[str, Any]:
    if device == "cuda":
        torch.cuda.set_device(0)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, size["vocab"], (batch, seq), generator=g).to(device)  # (B, T)
    systems = {name: _build(name, size, device, dtype) for name in SYSTEMS}

    def step(name: str) -> float:
        model, optimizer, extra = systems[name]
        started = time.perf_counter()
        if isinstance(extra, torch.dtype):  # plain_amp: autocast over fp32 weights
            with torch.autocast(device, dtype=extra, enabled=extra != torch.float32):
                loss = model(input_ids=tokens, labels=tokens).loss
            loss.backward()
        else:
            loss = model(input_ids=tokens, labels=tokens).loss
            extra.backward(loss) if extra is not None else loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - started

    for name in SYSTEMS:
        for _ in range(warmup):
            step(name)
    seconds: dict[str, list[float]] = {name: [] for name in SYSTEMS}
    per_round = max(1, -(-timed // rounds))
    for index in range(rounds):
        order = SYSTEMS[index % len(SYSTEMS):] + SYSTEMS[:index % len(SYSTEMS)]
        for name in order:
            seconds[name].extend(step(name) for _ in range(per_round))
    return {name: statistics.median(t) for name, t in seconds.items()}


def run(options: Options, checks: Checks) -> dict[str, Any]:
    if options.quick:
        size, dtype, batch, seq, warmup, timed, rounds = {"hidden": 32, "layers": 2, "vocab": 128}, "fp32", 4, 16, 1, 2, \
            2
    else:
        size, dtype, batch, seq, warmup, timed, rounds = {"hidden": 768, "layers": 12, "vocab": 50257,
                                                          "positions": 512}, "bf16", 8, 512, 3, 10, 5
    backend = "nccl" if options.device == "cuda" else "gloo"
    medians = in_process_group(time_rank, 1, size, options.device, dtype, batch, seq, warmup, timed, rounds,
                               backend=backend)
    for system in SYSTEMS:
        checks.add(f"{system} ran", medians.get(system, 0) > 0, medians.get(system))
    plain, amp = medians["plain"], medians["plain_amp"]
    table = {s: {"ms": round(1e3 * t, 2), "vs_plain": round(t / plain, 3), "vs_plain_amp": round(t / amp, 3)}
             for s, t in medians.items()}
    steps = rounds * max(1, -(-timed // rounds))
    return {"summary": {"model": size, "dtype": dtype, "batch": [batch, seq], "timed_steps": steps, "rounds": rounds,
                        "median": table}}
