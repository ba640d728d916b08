"""Section: step time at world 1 (nothing is communicated, so this is the engine's own overhead): hfzero
stages 0-3 against a plain AdamW loop and FSDP2 (``fully_shard`` per block and the root) on the same
GPT-2 (hidden 768, 12 layers, bf16, batch 8 x 512 on CUDA; --quick: a tiny fp32 one on the CPU).
Median of the timed steps after warm-up; on CUDA each step ends with ``torch.cuda.synchronize()``. The plain
loop holds the model in the run's dtype with AdamW over it (no fp32 master copy: the cheapest step);
FSDP2 and hfzero keep fp32 masters with 16-bit compute.
A figure, not a threshold: the check is that every system ran."""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

import hfzero
from hfzero.testing.gpu_check.common import Checks, Options, in_process_group
from hfzero.testing.models import tiny_causal_lm
from hfzero.testing.workloads import param_groups

SYSTEMS = ("plain", "fsdp2", "zero0", "zero1", "zero2", "zero3")


def _build(system: str, size: dict[str, int], device: str, dtype: str):
    model = tiny_causal_lm("gpt2", **size).to(device)
    torch_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    if system == "plain":
        model.to(torch_dtype)
        return model, torch.optim.AdamW(param_groups(model), lr=1e-4), None
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
              warmup: int, timed: int) -> dict[str, Any]:
    if device == "cuda":
        torch.cuda.set_device(0)
    out = {}
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, size["vocab"], (batch, seq), generator=g).to(device)  # (B, T)
    for system in SYSTEMS:
        model, optimizer, zero = _build(system, size, device, dtype)
        seconds = []
        for step in range(warmup + timed):
            started = time.perf_counter()
            loss = model(input_ids=tokens, labels=tokens).loss
            zero.backward(loss) if zero is not None else loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            if device == "cuda":
                torch.cuda.synchronize()
            if step >= warmup:
                seconds.append(time.perf_counter() - started)
        out[system] = statistics.median(seconds)
        del model, optimizer, zero
        if device == "cuda":
            torch.cuda.empty_cache()
    return out


def run(options: Options, checks: Checks) -> dict[str, Any]:
    if options.quick:
        size, dtype, batch, seq, warmup, timed = {"hidden": 32, "layers": 2, "vocab": 128}, "fp32", 4, 16, 1, 2
    else:
        size, dtype, batch, seq, warmup, timed = {"hidden": 768, "layers": 12, "vocab": 50257, "positions": 512}, \
            "bf16", 8, 512, 3, 10
    backend = "nccl" if options.device == "cuda" else "gloo"
    medians = in_process_group(time_rank, 1, size, options.device, dtype, batch, seq, warmup, timed, backend=backend)
    for system in SYSTEMS:
        checks.add(f"{system} ran", medians.get(system, 0) > 0, medians.get(system))
    plain = medians["plain"]
    table = {s: {"ms": round(1e3 * t, 2), "vs_plain": round(t / plain, 3)} for s, t in medians.items()}
    return {"summary": {"model": size, "dtype": dtype, "batch": [batch, seq], "timed_steps": timed, "median": table}}
