"""What the per-step heap trim of CPU engines costs and saves (``ZeroConfig.host_trim``, see
[Note: host allocator] in hfzero/runtime/hostmem.py): step time, the time inside ``malloc_trim`` and the
peak RSS growth, trim on and off, in alternating runs of their own processes (the trim is process-wide,
so the two cannot share a process).

    python benchmarks/host_trim.py [--hidden 256] [--layers 4] [--stage 3] [--micro 4] [--steps 10] [--repeats 2]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import hfzero
import hfzero.runtime.optimizer as zero_optimizer
from hfzero.testing import run_distributed
from hfzero.testing.models import tiny_causal_lm

VOCAB = 8192


def _hwm() -> int:
    with open("/proc/self/status", encoding="ascii") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def bench(rank: int, world: int, args: argparse.Namespace, trim: bool) -> dict[str, object]:
    trim_seconds: list[float] = []
    inner = zero_optimizer.trim_host_heap

    def timed() -> bool:
        start = time.perf_counter()
        released = inner()
        trim_seconds.append(time.perf_counter() - start)
        return released

    zero_optimizer.trim_host_heap = timed  # the optimizer's own call, timed
    model = tiny_causal_lm("gpt2", hidden=args.hidden, layers=args.layers, vocab=VOCAB, positions=128)
    config = hfzero.ZeroConfig(stage=args.stage, host_trim=trim)
    model, optimizer = hfzero.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-4), config)
    generator = torch.Generator().manual_seed(rank)
    times, peaks = [], []
    for _ in range(args.steps):
        start = time.perf_counter()
        for index in range(args.micro):
            batch = torch.randint(0, VOCAB, (2, 64), generator=generator)  # (B, T) per rank
            if index < args.micro - 1:
                with optimizer.no_sync():
                    optimizer.backward(model(input_ids=batch, labels=batch).loss / args.micro)
            else:
                optimizer.backward(model(input_ids=batch, labels=batch).loss / args.micro)
        optimizer.step()
        optimizer.zero_grad()
        times.append(time.perf_counter() - start)
        peaks.append(_hwm())
    return {"step": statistics.median(times[1:]), "trim": statistics.median(trim_seconds) if trim_seconds else 0.0,
            "growth": peaks[-1] / peaks[1]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--stage", type=int, default=3)
    parser.add_argument("--micro", type=int, default=4)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--world", type=int, default=2)
    args = parser.parse_args()
    results: dict[bool, list[dict]] = {True: [], False: []}
    for _ in range(args.repeats):
        for trim in (True, False):
            results[trim].append(max(run_distributed(bench, args.world, args, trim), key=lambda r: r["step"]))
    print(f"GPT-2 {args.hidden} wide x {args.layers}, stage {args.stage}, {args.micro} micro-batches per step, world "
          f"{args.world}, {args.steps} steps; medians, slowest rank; runs alternate trim on / off")
    for trim, runs in results.items():
        step = statistics.median(r["step"] for r in runs)
        inside = statistics.median(r["trim"] for r in runs)
        growth = ", ".join(f"{r['growth']:.3f}" for r in runs)
        print(f"host_trim={trim!s:<5}  step {step:.3f}s  malloc_trim {1000 * inside:.1f} ms  "
              f"peak step {args.steps} / step 2: {growth}")
    ratio = statistics.median(r["step"] for r in results[True]) / statistics.median(r["step"] for r in results[False])
    print(f"step time, trim on / off: {ratio:.3f}")


if __name__ == "__main__":
    main()
