"""Profiler overhead: the same ZeRO training loop timed with and without ZeroProfiler, side by side.

Each trial times ``--steps`` steps without the profiler, then ``--steps`` steps with a fresh profiler
(default settings: every step recorded, no CUDA snapshot), on the same prepared model, alternating so
drift hits both alike. Starting the profiler (header, run-id broadcast) is outside the timed region:
it happens once per run, not per step. Prints the median block times, the median over trials of the
profiled / plain ratio of adjacent blocks (target <= 1.02), the same ratio of process CPU time, and
the wall and CPU time spent inside the profiler's hooks (``ZeroProfiler.overhead_seconds`` and
``overhead_cpu_seconds``), which measure the profiler's cost directly rather than as a difference of
two noisy totals; on a shared machine the CPU-time ratio is the one to trust.

    python benchmarks/profiler_overhead.py                      # 2 gloo ranks, stage 2, bf16
    python benchmarks/profiler_overhead.py --world-size 1 --stage 1 --json
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

import hfzero
from hfzero.profiler import ZeroProfiler
from hfzero.testing.models import tiny_causal_lm, token_batches
from hfzero.testing.spawn import run_distributed

VOCAB = 1024


def _timed_steps(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 batches: list[torch.Tensor]) -> tuple[float, float]:
    """(wall seconds, process CPU seconds) of one training step per batch."""
    wall, cpu = time.perf_counter(), time.process_time()
    for ids in batches:
        loss = model(input_ids=ids, labels=ids).loss
        optimizer.backward(loss)
        optimizer.clip_grad_norm_(1.0)
        optimizer.step()
        optimizer.zero_grad()
    return time.perf_counter() - wall, time.process_time() - cpu


def _bench(rank: int, world_size: int, args: dict[str, Any]) -> dict[str, Any]:
    config = hfzero.ZeroConfig(stage=args["stage"], dtype=args["dtype"])
    model = tiny_causal_lm("gpt2", hidden=args["n_embd"], layers=args["n_layer"], vocab=VOCAB,
                           positions=args["seq_len"])
    model, optimizer = hfzero.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-4), config)
    batches = token_batches(args["steps"], args["batch"], args["seq_len"], vocab=VOCAB, seed=rank)
    _timed_steps(model, optimizer, batches[:2])  # warm-up: allocator, optimizer states, autograd caches
    plain, profiled, in_hooks = [], [], []
    with tempfile.TemporaryDirectory() as root:
        for trial in range(args["trials"]):
            plain.append(_timed_steps(model, optimizer, batches))
            with ZeroProfiler(model, optimizer, Path(root) / f"trial{trial}") as profiler:
                profiled.append(_timed_steps(model, optimizer, batches))
            in_hooks.append((profiler.overhead_seconds, profiler.overhead_cpu_seconds))
    return {"plain": [w for w, _ in plain], "profiled": [w for w, _ in profiled],
            "plain_cpu": [c for _, c in plain], "profiled_cpu": [c for _, c in profiled],
            "in_hooks": [w for w, _ in in_hooks], "in_hooks_cpu": [c for _, c in in_hooks],
            "num_params": hfzero.get_engine(model).num_params}


def _median_ratio(before: list[float], after: list[float]) -> float:
    """Median over trials of after / before for adjacent blocks (drift and load hit both alike)."""
    return statistics.median(b / a for a, b in zip(before, after))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--stage", type=int, default=2)
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--n-embd", type=int, default=256)
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=10, help="steps per timed block")
    parser.add_argument("--trials", type=int, default=5, help="alternating plain/profiled block pairs")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    results = run_distributed(_bench, args.world_size, vars(args), timeout=1800)
    rank0 = results[0]
    plain, profiled = statistics.median(rank0["plain"]), statistics.median(rank0["profiled"])
    in_hooks = statistics.median(rank0["in_hooks"])
    in_hooks_cpu, plain_cpu = statistics.median(rank0["in_hooks_cpu"]), statistics.median(rank0["plain_cpu"])
    report = {
        "world_size": args.world_size, "stage": args.stage, "dtype": args.dtype, "num_params": rank0["num_params"],
        "steps_per_block": args.steps, "trials": args.trials,
        "plain_step_s": plain / args.steps, "profiled_step_s": profiled / args.steps,
        "overhead_per_step_ms": 1e3 * (profiled - plain) / args.steps,
        "ratio": _median_ratio(rank0["plain"], rank0["profiled"]),
        "cpu_ratio": _median_ratio(rank0["plain_cpu"], rank0["profiled_cpu"]),
        "in_hooks_per_step_ms": 1e3 * in_hooks / args.steps,
        "in_hooks_ratio": (plain + in_hooks) / plain,
        "in_hooks_cpu_per_step_ms": 1e3 * in_hooks_cpu / args.steps,
        "in_hooks_cpu_ratio": (plain_cpu + in_hooks_cpu) / plain_cpu,
        "plain_blocks_s": rank0["plain"], "profiled_blocks_s": rank0["profiled"],
    }
    if args.json:
        print(json.dumps(report, indent=2))
        return
    print(f"{report['num_params']:,} parameters, stage {args.stage}, {args.dtype}, {args.world_size} rank(s), "
          f"{args.trials} x {args.steps} steps each way")
    print(f"plain     {1e3 * report['plain_step_s']:8.2f} ms/step (median block)")
    print(f"profiled  {1e3 * report['profiled_step_s']:8.2f} ms/step (median block)")
    print(f"ratio     {report['ratio']:.4f}  (median of adjacent-block ratios; target <= 1.02; "
          f"{report['overhead_per_step_ms']:+.2f} ms/step between the medians)")
    print(f"cpu ratio {report['cpu_ratio']:.4f}  (process CPU time, adjacent blocks)")
    print(f"in hooks  {report['in_hooks_per_step_ms']:8.3f} ms/step wall (the profiler's own time: ratio "
          f"{report['in_hooks_ratio']:.4f})")
    print(f"in hooks  {report['in_hooks_cpu_per_step_ms']:8.3f} ms/step CPU  (against the plain loop's CPU time: "
          f"ratio {report['in_hooks_cpu_ratio']:.4f}; the figure least disturbed by other processes)")


if __name__ == "__main__":
    main()
