"""Stage-3 step time and memory against ``param_persistence_threshold``, side by side in one run.

    python benchmarks/persistence_threshold.py [--world 2] [--steps 10] [--thresholds 0 1000 10000 100000 1000000]

Small parameters (biases, norms) cost a collective each to gather but little memory to keep whole;
this measures the trade-off on the benchmark model and prints step time relative to threshold 0
and the persistent fraction of the model.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

import hfzero
from hfzero.testing import run_distributed
from hfzero.testing.models import tiny_causal_lm


def bench(rank: int, world: int, args: argparse.Namespace) -> dict[int, dict[str, float]]:
    variants = {}
    for threshold in args.thresholds:
        model = tiny_causal_lm("gpt2", hidden=args.hidden, layers=args.layers, vocab=args.vocab, positions=args.seq)
        config = hfzero.ZeroConfig(stage=3, param_persistence_threshold=threshold)
        model, optimizer = hfzero.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-4), config)
        variants[threshold] = (model, optimizer, hfzero.get_engine(model))
    batch = torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(rank))
    times: dict[int, list[float]] = {t: [] for t in variants}
    for step in range(args.steps + 2):
        for threshold, (model, optimizer, engine) in variants.items():
            dist.barrier()
            start = time.perf_counter()
            optimizer.backward(model(input_ids=batch, labels=batch).loss)
            optimizer.step()
            dist.barrier()
            if step >= 2:
                times[threshold].append(time.perf_counter() - start)
    return {t: {"median_s": statistics.median(times[t]),
                "persistent_fraction": variants[t][2].num_persistent_params / variants[t][2].num_params,
                "model_state_bytes": variants[t][2].model_state_bytes()} for t in variants}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--thresholds", type=int, nargs="+", default=[0, 1000, 10_000, 100_000, 1_000_000])
    args = parser.parse_args()
    figures = run_distributed(bench, args.world, args, timeout=1800)[0]
    base = figures[args.thresholds[0]]["median_s"]
    print(f"stage 3, world {args.world}, gloo, GPT-2 hidden {args.hidden} x {args.layers}, vocab {args.vocab}")
    print(f"{'threshold':>10} {'step s':>8} {'x first':>8} {'persistent %':>13} {'model states MB':>16}")
    for t, f in figures.items():
        print(f"{t:>10} {f['median_s']:>8.4f} {f['median_s'] / base:>8.3f} {100 * f['persistent_fraction']:>12.1f}% "
              f"{f['model_state_bytes'] / 1e6:>16.2f}")


if __name__ == "__main__":
    main()
