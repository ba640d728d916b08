"""Gradient accumulation x ZeRO stage x accumulation policy, side by side: the measured answer to
"ZeRO-2 shards gradients but accumulation needs them whole: how do they work together?" for data
parallelism.

For stage 1, stage 2 "sharded", stage 2 "local" and stage 3 (each stage's default policy unless named)
at accumulation 1, 4 and 8 on a 2-rank gloo group: the median step time (ratio to stage 1 at the same
accumulation, taken in interleaved rounds so machine noise hits every variant alike), the peak
model-state bytes per rank sampled after every micro-batch's backward (what is held across
micro-batches counts), and the communication elements per step, beside the estimator's figures.

    python benchmarks/accumulation.py [--steps 6] [--hidden 256] [--layers 4] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

import hfzero
from hfzero.planning.estimate import comm_elements_per_step, model_states_bytes, precision_bytes
from hfzero.testing import run_distributed
from hfzero.testing.models import tiny_causal_lm

VARIANTS = {"stage1": (1, "auto"), "stage2-sharded": (2, "sharded"), "stage2-local": (2, "local"),
            "stage3": (3, "auto")}


def _build(stage: int, policy: str, args: argparse.Namespace):
    model = tiny_causal_lm("gpt2", hidden=args.hidden, layers=args.layers, vocab=args.vocab, positions=args.seq)
    config = hfzero.ZeroConfig(stage=stage, dtype=args.dtype, accumulation=policy, reduce_bucket_size=args.bucket)
    model, optimizer = hfzero.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-4), config)
    return model, optimizer, hfzero.get_engine(model)


def _step(model, optimizer, engine, micro: list[torch.Tensor]) -> int:
    """One optimizer step over ``micro`` (no_sync around all but the last); returns the peak model-state
    bytes seen after each backward and before the update."""
    peak = 0
    for index, ids in enumerate(micro):
        loss = model(input_ids=ids, labels=ids).loss / len(micro)
        if index < len(micro) - 1:
            with optimizer.no_sync():
                optimizer.backward(loss)
        else:
            optimizer.backward(loss)
        peak = max(peak, engine.model_state_bytes())
    optimizer.clip_grad_norm_(1.0)
    optimizer.step()
    optimizer.zero_grad()
    return peak


def bench(rank: int, world: int, args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    g = torch.Generator().manual_seed(rank)
    for accumulation in args.accumulation:
        micro = [torch.randint(0, args.vocab, (args.batch, args.seq), generator=g) for _ in range(accumulation)]
        built = {name: _build(stage, policy, args) for name, (stage, policy) in VARIANTS.items()}
        times = {name: [] for name in built}
        peaks = {name: 0 for name in built}
        comm = {}
        for step in range(args.steps + 1):
            for name, (model, optimizer, engine) in built.items():
                before = engine.comm.stats()
                dist.barrier()
                start = time.perf_counter()
                peak = _step(model, optimizer, engine, micro)
                dist.barrier()
                if step >= 1:  # warm-up excluded
                    times[name].append(time.perf_counter() - start)
                peaks[name] = max(peaks[name], peak)
                after = engine.comm.stats()
                comm[name] = {k: after[k].elements - (before[k].elements if k in before else 0) for k in after}
        for name, (_, _, engine) in built.items():
            out[f"{name}@{accumulation}"] = {
                "median_s": statistics.median(times[name]), "peak_model_state_bytes": peaks[name],
                "comm_elements": sum(v for k, v in comm[name].items() if k != "all_reduce" or engine.stage == 0),
                "num_params": engine.num_params, "policy": engine.accumulation,
                "persistent": getattr(engine, "num_persistent_params", 0)}
        del built
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=2, help="micro-batch size per rank")
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--bucket", type=int, default=2_000_000)
    parser.add_argument("--accumulation", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--json", help="also write the figures to this JSON file")
    args = parser.parse_args()
    figures = run_distributed(bench, args.world, args, timeout=3600)[0]
    p, g, k = precision_bytes(args.dtype, "adam")
    print(f"world {args.world}, gloo, GPT-2 hidden {args.hidden} x {args.layers} layers, vocab {args.vocab}, "
          f"seq {args.seq}, micro-batch {args.batch}/rank, {args.dtype} AdamW, {args.steps} timed steps (median); "
          "model states = peak per rank over micro-batches; comm = elements per step per rank (clip norm aside)")
    print(f"{'variant':<16} {'accum':>5} {'step s':>8} {'x stage1':>8} {'model states MB':>16} {'estimate MB':>12} "
          f"{'comm / Ψ':>9} {'estimate':>9}")
    rows = []
    for accumulation in args.accumulation:
        base = figures[f"stage1@{accumulation}"]["median_s"]
        for name, (stage, _) in VARIANTS.items():
            fig = figures[f"{name}@{accumulation}"]
            psi = fig["num_params"]
            kwargs = dict(accumulation_steps=accumulation, accumulation=fig["policy"], persistent_params=fig["persistent"])
            est_bytes = model_states_bytes(psi, args.world, stage, param_bytes=p, grad_bytes=g, optimizer_k=k, **kwargs)
            est_comm = comm_elements_per_step(psi, args.world, stage, **kwargs)
            row = {"variant": name, "accumulation": accumulation, "median_step_s": round(fig["median_s"], 4),
                   "ratio_vs_stage1": round(fig["median_s"] / base, 3),
                   "model_state_MB": round(fig["peak_model_state_bytes"] / 1e6, 3),
                   "estimate_MB": round(est_bytes / 1e6, 3), "comm_psi": round(fig["comm_elements"] / psi, 3),
                   "estimate_comm_psi": round(est_comm / psi, 3)}
            rows.append(row)
            print(f"{name:<16} {accumulation:>5} {row['median_step_s']:>8.4f} {row['ratio_vs_stage1']:>8.3f} "
                  f"{row['model_state_MB']:>16.3f} {row['estimate_MB']:>12.3f} {row['comm_psi']:>9.3f} "
                  f"{row['estimate_comm_psi']:>9.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
