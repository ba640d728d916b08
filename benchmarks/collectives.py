"""Measure reduce-scatter natively vs as an all-reduce on this backend, to back comm.py's choice.

    python benchmarks/collectives.py [--world 2] [--backend gloo] [--mb 4 25 100]

Prints, per message size, the median time of a native reduce_scatter and of an all-reduce of the
same input (what `reduce_scatter_impl="all_reduce"` runs), and their ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from hfzero.testing import run_distributed

_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _time(fn, repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def measure(rank: int, world: int, sizes_mb: list[float], repeats: int) -> list[tuple[float, float, float]]:
    rows = []
    for mb in sizes_mb:
        n = int(mb * 1e6 / 4) // world * world
        full = torch.randn(n)
        out = torch.empty(n // world)
        native = _time(lambda: _reduce_scatter(out, full), repeats)
        via_all_reduce = _time(lambda: dist.all_reduce(full), repeats)
        rows.append((mb, native, via_all_reduce))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--backend", default="gloo")
    parser.add_argument("--mb", type=float, nargs="+", default=[4, 25, 100])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    rows = run_distributed(measure, args.world, args.mb, args.repeats, backend=args.backend)[0]
    print(f"{args.backend}, world {args.world}: median of {args.repeats}")
    print(f"{'MB':>6} {'reduce_scatter s':>17} {'all_reduce s':>13} {'rs / ar':>8}")
    for mb, native, via in rows:
        print(f"{mb:>6.0f} {native:>17.4f} {via:>13.4f} {native / via:>8.2f}")


if __name__ == "__main__":
    main()
