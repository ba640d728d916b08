"""Mixture-of-experts: stage 3 alone vs stage 3 (and 1, 2) + expert parallelism, side by side, on 4 gloo ranks.

A Qwen3-MoE-shaped model from config (most parameters in experts). Per variant: the bytes each rank sends
per optimizer step (all of the engine's collectives, the all-to-all token exchange counted under its own
kind), the median step time (variants interleaved in rounds, so machine noise hits each alike), the
per-rank model-state bytes beside ``hfzero.planning.estimate`` (``expert_parallel_bytes``), and the losses against
torch DDP on the same global batch (fp32; run first and freed before the variants are built; with
``--dtype bf16``, against the plain stage-3 run). Every variant is data-parallel on the same global batch, so
losses agree to fp32 rounding. Under EP the dense parameters are sharded over the world and the experts over
the expert-data-parallel group: with ep = world (4) that group is one rank, so a rank's E / 4 experts stay
whole while its dense parameters are sharded over 4 (stage 3 + EP=4 holds plain stage 3's bytes); stage 3 +
EP=2 shards the experts over edp = 2.
The model measured in docs/moe.md: ``--experts 32 --top-k 4 --hidden 512 --expert-hidden 256 --layers 4``
(54.1M parameters, 93% in experts); ``--expert-hidden 384`` gives ~79M. The default is a quick small one.

    python benchmarks/moe.py [--steps 4] [--rounds 2] [--experts 16] [--json OUT]
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

import hfzero
from hfzero.planning.estimate import expert_parallel_bytes
from hfzero.testing import run_distributed
from hfzero.testing.models import tiny_moe_lm

WORLD = 4
VARIANTS = {"stage3": (3, 1), "stage3+ep4": (3, 4), "stage2+ep4": (2, 4), "stage1+ep4": (1, 4), "stage3+ep2": (3, 2)}


def _model(args: argparse.Namespace) -> torch.nn.Module:
    return tiny_moe_lm(hidden=args.hidden, layers=args.layers, experts=args.experts, top_k=args.top_k,
                       expert_hidden=args.expert_hidden, vocab=args.vocab, positions=args.seq,
                       implementation="grouped_mm")


def _build(stage: int, ep: int, args: argparse.Namespace):
    from hfzero.parallel.expert import prepare_expert_parallel

    # threshold 0: every parameter partitioned at stage 3 (none kept whole), as the estimator's formula counts
    config = hfzero.ZeroConfig(stage=stage, ep_size=ep, dtype=args.dtype, param_persistence_threshold=0)
    factory = lambda params: torch.optim.AdamW(params, lr=1e-4)  # noqa: E731
    if ep > 1:
        model, optimizer, _ = prepare_expert_parallel(_model(args), factory, config)
    else:
        model = _model(args)
        model, optimizer = hfzero.prepare(model, factory(model.parameters()), config)
    return model, optimizer, hfzero.get_engine(model)


def _ddp_losses(rank: int, world: int, args: argparse.Namespace, batches: list[torch.Tensor]) -> list[float]:
    """torch DDP on the same global batch (every rank its own rows, gradients averaged over the world): the
    losses the ZeRO variants are compared with. Freed before the variants are built."""
    from torch.nn.parallel import DistributedDataParallel

    model = DistributedDataParallel(_model(args))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    losses = []
    for ids in batches:
        mine = ids.chunk(world)[rank]
        loss = model(input_ids=mine, labels=mine).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    del model, optimizer
    gc.collect()
    return losses


def _worker(rank: int, world: int, args: argparse.Namespace) -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, args.vocab, (args.batch * world, args.seq), generator=g) for _ in range(args.steps)]
    ddp = _ddp_losses(rank, world, args, batches) if args.fp32_ddp else None
    built = {name: _build(stage, ep, args) for name, (stage, ep) in VARIANTS.items()}
    out: dict[str, Any] = {name: {"times": [], "losses": [], "bytes": [], "a2a": []} for name in VARIANTS}
    out["ddp_losses"] = ddp
    for round_ in range(args.rounds):
        for name, (model, optimizer, engine) in built.items():
            for step, ids in enumerate(batches):
                mine = ids.chunk(world)[rank]
                before = engine.comm.stats()
                dist.barrier()
                started = time.perf_counter()
                loss = model(input_ids=mine, labels=mine).loss
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                elapsed = time.perf_counter() - started
                after = engine.comm.stats()
                moved = {k: after[k].bytes - (before[k].bytes if k in before else 0) for k in after}
                if step > 0:  # the first step of a round warms up
                    out[name]["times"].append(elapsed)
                if round_ == 0:
                    total = loss.detach().clone()
                    dist.all_reduce(total)
                    out[name]["losses"].append(total.item() / world)
                    out[name]["bytes"].append(sum(moved.values()))
                    out[name]["a2a"].append(moved.get("all_to_all", 0))
            out[name]["model_states"] = engine.model_state_bytes()
            out[name]["padded"], out[name]["num_params"] = engine.num_params_padded, engine.num_params
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--expert-hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=2, help="rows per rank")
    parser.add_argument("--dtype", default="fp32")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    args.fp32_ddp = args.dtype == "fp32"  # the DDP reference runs the model as built (fp32)

    model = _model(args)
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    dense = sum(p.numel() for p in model.parameters()) - experts
    size = {"fp32": (4, 4, 8), "bf16": (2, 2, 12)}[args.dtype]
    ranks = run_distributed(_worker, WORLD, args, timeout=3600)
    base = ranks[0]["stage3"]
    reference = ranks[0]["ddp_losses"] or base["losses"]  # DDP's (fp32), else plain stage 3's
    rows = []
    print(f"model: {dense + experts:,} parameters, {experts / (dense + experts):.0%} in experts; world {WORLD}, "
          f"{args.experts} experts top-{args.top_k}, {args.batch} x {args.seq} tokens per rank, {args.dtype}")
    print(f"{'variant':<12} {'bytes/rank/step':>16} {'of which a2a':>13} {'vs stage3':>10} {'step s':>8} "
          f"{'states/rank':>12} {'estimate':>12} {'max |dloss|':>12}")
    print(f"losses compared with {'torch DDP' if ranks[0]['ddp_losses'] else 'plain stage 3'} on the same global "
          "batch")
    for name, (stage, ep) in VARIANTS.items():
        mine = ranks[0][name]
        per_step = statistics.median(max(r[name]["bytes"][i] for r in ranks) for i in range(args.steps))
        a2a = statistics.median(max(r[name]["a2a"][i] for r in ranks) for i in range(args.steps))
        ratio = mine["padded"] / mine["num_params"]
        estimate = expert_parallel_bytes(dense * ratio, experts * ratio, WORLD, ep, stage, param_bytes=size[0],
                                         grad_bytes=size[1], optimizer_k=size[2]).total
        step = statistics.median(max(r[name]["times"][i] for r in ranks) for i in range(len(mine["times"])))
        dloss = max(abs(a - b) for a, b in zip(mine["losses"], reference, strict=True))
        base_bytes = statistics.median(max(r["stage3"]["bytes"][i] for r in ranks) for i in range(args.steps))
        rows.append({"variant": name, "bytes_per_rank_step": per_step, "all_to_all_bytes": a2a,
                     "bytes_ratio_vs_stage3": base_bytes / per_step, "step_seconds": step,
                     "model_states": mine["model_states"], "estimate": estimate, "max_dloss": dloss})
        print(f"{name:<12} {per_step:>16,.0f} {a2a:>13,.0f} {base_bytes / per_step:>9.2f}x {step:>8.3f} "
              f"{mine['model_states']:>12,} {estimate:>12,.0f} {dloss:>12.2e}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "dense_params": dense, "expert_params": experts, "rows": rows,
                       "ddp_losses": ranks[0]["ddp_losses"]}, f, indent=1)


if __name__ == "__main__":
    main()
