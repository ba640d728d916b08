"""Bytes per step per rank, total and inter-node, for flat ZeRO against HSDP on simulated nodes.

    python benchmarks/scale_out.py [--world 4] [--ranks-per-node 2] [--steps 3] [--accumulation 1] [--json]

Every rank of ``--world`` gloo ranks trains a GPT-2 (``--hidden`` x ``--layers``, fp32) for a few steps under
each system, one after the other in one spawn; ``--ranks-per-node`` simulates nodes (``ZeroConfig.ranks_per_node``).
Bytes are deterministic, so a few steps suffice; they follow the paper's logical volume and the node split of
[Note: node traffic] in hfzero/comm.py. Printed beside the closed form of docs/multinode.md:
flat stage 3 crosses nodes with half of (A + 2A) Ψ_p x 4 bytes on 2 nodes (2 of 4 ring hops cross), HSDP with the
shard group = a node with 2 x Ψ_p / G x 4 bytes (the replicate all-reduce of the shard), plus the clip norm;
stage 3 with hpZ (secondary partition) with half of (A + A) Ψ_p x 4 bytes (backward gathers stay in the node).
Step time on gloo is printed too (wall, median), for what it is: all ranks share this host's cores.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist

import hfzero
from hfzero.testing import run_distributed
from hfzero.testing.models import micro_batches, tiny_causal_lm, token_batches

SYSTEMS = {  # name -> (stage, shard_size, hpZ); shard_size -1: the ranks per node
    "flat stage 2": (2, 0, False),
    "HSDP stage 2": (2, -1, False),
    "flat stage 3": (3, 0, False),
    "HSDP stage 3": (3, -1, False),
    "stage 3 + hpZ": (3, 0, True),
}


def bench(rank: int, world: int, args: argparse.Namespace) -> dict[str, dict[str, float]]:
    out = {}
    batches = token_batches(args.steps, world * args.accumulation * 2, args.seq, vocab=args.vocab)
    for name, (stage, shard, hpz) in SYSTEMS.items():
        model = tiny_causal_lm("gpt2", hidden=args.hidden, layers=args.layers, vocab=args.vocab, positions=args.seq)
        config = hfzero.ZeroConfig(stage=stage, shard_size=args.ranks_per_node if shard < 0 else shard,
                                   ranks_per_node=args.ranks_per_node, param_persistence_threshold=0,
                                   secondary_partition=hpz)
        model, optimizer = hfzero.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-4), config)
        engine = hfzero.get_engine(model)
        totals, inter, seconds = [], [], []
        for batch in batches:
            before = engine.comm.stats()
            dist.barrier()
            start = time.perf_counter()
            for mb in micro_batches(batch, rank, world, args.accumulation):
                optimizer.backward(model(input_ids=mb, labels=mb).loss / args.accumulation)
            optimizer.clip_grad_norm_(1.0)
            optimizer.step()
            optimizer.zero_grad()
            dist.barrier()
            seconds.append(time.perf_counter() - start)
            after = engine.comm.stats()
            totals.append(sum(s.bytes - (before[k].bytes if k in before else 0) for k, s in after.items()))
            inter.append(sum(s.inter_node_bytes - (before[k].inter_node_bytes if k in before else 0)
                             for k, s in after.items()))
        padded, shard_numel = engine.num_params_padded, engine.layout.shard_numel
        a = args.accumulation
        if engine.replicate is None:
            elements = (a + (2 * a if stage == 3 else 1)) * padded + 2
            crossing = engine.comm.node_crossings / engine.comm.world_size
            if hpz:  # the backward gathers stay in the node
                elements -= a * padded
            model_inter = 4 * elements * crossing
        else:
            model_inter = 4 * 2 * shard_numel
        out[name] = {"bytes_per_step": statistics.mean(totals), "inter_node_bytes_per_step": statistics.mean(inter),
                     "model_inter_node_bytes": model_inter, "step_seconds": statistics.median(seconds),
                     "model_state_bytes": engine.model_state_bytes(), "params": engine.num_params}
        del model, optimizer, engine
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--ranks-per-node", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--accumulation", type=int, default=1)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args()
    figures = run_distributed(bench, args.world, args, timeout=1800)[0]  # rank 0's; every rank moves the same
    if args.json:
        print(json.dumps(figures, indent=1))
        return
    flat = figures["flat stage 3"]["inter_node_bytes_per_step"]
    print(f"world {args.world} on {args.world // args.ranks_per_node} simulated node(s), gloo, fp32 GPT-2 hidden "
          f"{args.hidden} x {args.layers}, vocab {args.vocab}, accumulation {args.accumulation}; per rank per step")
    print(f"{'system':<14} {'bytes':>12} {'inter-node':>12} {'model':>12} {'vs flat s3':>10} {'states':>11} {'step s':>7}")
    for name, f in figures.items():
        print(f"{name:<14} {f['bytes_per_step']:>12,.0f} {f['inter_node_bytes_per_step']:>12,.0f} "
              f"{f['model_inter_node_bytes']:>12,.0f} {f['inter_node_bytes_per_step'] / flat:>10.3f} "
              f"{f['model_state_bytes']:>11,} {f['step_seconds']:>7.3f}")


if __name__ == "__main__":
    main()
