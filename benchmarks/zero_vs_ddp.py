"""Side-by-side step time and memory: torch DDP, FSDP2, DeepSpeed ZeRO 1-3 (when installed:
`DS_BUILD_OPS=0 pip install deepspeed`) and hfzero stages 0-3 on the same model.

All variants live in the same 2-rank gloo process group and are stepped in interleaved rounds, so
machine noise hits them alike; the figures are ratios to DDP taken in one run. hfzero's CPU host-allocator
policy is process-wide, so here it applies to every variant: compare step time and peak memory against
DDP, each engine in processes of its own, with benchmarks/host_policy.py. Usage:

    python benchmarks/zero_vs_ddp.py [--world 2] [--steps 12] [--hidden 256] [--layers 4] [--json OUT]
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
from hfzero.testing import run_distributed
from hfzero.testing.models import tiny_causal_lm


VARIANTS = ["ddp", "fsdp2", "deepspeed1", "deepspeed2", "deepspeed3", "zero0", "zero1", "zero2", "zero3",
            "zero3-noverify"]
"""zero3-noverify: stage 3 without the per-gather order check (prepare(..., verify_gather_order=False))."""


def _build(name: str, args: argparse.Namespace):
    model = tiny_causal_lm("gpt2", hidden=args.hidden, layers=args.layers, vocab=args.vocab, positions=args.seq)
    if name == "ddp":
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        return ddp, torch.optim.AdamW(ddp.parameters(), lr=1e-4), None
    if name == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for block in model.transformer.h:
            fully_shard(block)
        fully_shard(model)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-4), None
    if name.startswith("deepspeed"):
        return _build_deepspeed(model, int(name.removeprefix("deepspeed")), args)
    stage = int(name.removeprefix("zero")[0])
    config = hfzero.ZeroConfig(stage=stage, reduce_bucket_size=args.bucket or 0)  # None/0: sized to the model
    extra = {"verify_gather_order": False} if name.endswith("-noverify") else {}
    try:
        model, optimizer = hfzero.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-4), config, **extra)
    except hfzero.ConfigError:
        return None
    return model, optimizer, hfzero.get_engine(model)


def _build_deepspeed(model, stage: int, args: argparse.Namespace):
    """DeepSpeed's ZeRO as a peer (never a dependency of hfzero); None when it is not installed."""
    try:
        import deepspeed
    except ImportError:
        return None
    buckets = {} if args.bucket is None else {"reduce_bucket_size": args.bucket, "allgather_bucket_size": args.bucket}
    config = {"train_micro_batch_size_per_gpu": args.batch, "gradient_accumulation_steps": 1,
              "gradient_clipping": 1.0, "zero_allow_untested_optimizer": True,
              "zero_optimization": {"stage": stage, "overlap_comm": True, **buckets}}  # None: DeepSpeed's defaults
    engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-4),
                                                   config=config)
    return engine, optimizer, "deepspeed"


def _step(model, optimizer, engine, batch: torch.Tensor) -> int:
    """One training step; returns model-state bytes after the update, before gradients are dropped."""
    loss = model(input_ids=batch, labels=batch).loss
    if engine == "deepspeed":  # clipping, step and zeroing happen inside DeepSpeed's engine
        model.backward(loss)
        model.step()
        return 0
    loss.backward()
    if engine is None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    else:
        optimizer.clip_grad_norm_(1.0)
    optimizer.step()
    held = _model_state_bytes(model, optimizer, engine)
    optimizer.zero_grad()
    return held


def _model_state_bytes(model, optimizer, engine) -> int:
    if engine is not None:
        return engine.model_state_bytes()
    params = {p: None for p in model.parameters()}
    local = lambda t: t.to_local() if hasattr(t, "to_local") else t  # noqa: E731 - FSDP2 DTensors
    total = sum(local(p).numel() * local(p).element_size() for p in params)
    total += sum(local(p.grad).numel() * local(p.grad).element_size() for p in params if p.grad is not None)
    for state in optimizer.state.values():
        total += sum(local(v).numel() * local(v).element_size() for v in state.values() if torch.is_tensor(v))
    return total


def bench(rank: int, world: int, args: argparse.Namespace) -> dict[str, Any]:
    variants = {n: v for n in args.variants if (v := _build(n, args)) is not None}
    g = torch.Generator().manual_seed(rank)
    batch = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
    times: dict[str, list[float]] = {n: [] for n in variants}
    peak: dict[str, int] = {n: 0 for n in variants}
    for step in range(args.steps + 2):
        for name, (model, optimizer, engine) in variants.items():
            dist.barrier()
            start = time.perf_counter()
            held = _step(model, optimizer, engine, batch)
            dist.barrier()
            if step >= 2:  # warm-up excluded
                times[name].append(time.perf_counter() - start)
            peak[name] = max(peak[name], held)
    return {n: {"median_s": statistics.median(t), "model_state_bytes": peak[n]} for n, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--bucket", type=int, default=2_000_000)
    parser.add_argument("--variants", nargs="+", default=VARIANTS, choices=VARIANTS,
                        help="what to run side by side (ddp first: ratios are to DDP)")
    parser.add_argument("--json", help="also write the figures to this JSON file")
    args = parser.parse_args()
    per_rank = run_distributed(bench, args.world, args, timeout=1800)
    ddp = per_rank[0]["ddp"]["median_s"]
    rows = []
    for name, fig in per_rank[0].items():
        rows.append({"variant": name, "median_step_s": round(fig["median_s"], 4),
                     "ratio_vs_ddp": round(fig["median_s"] / ddp, 3),
                     "model_state_MB_rank0": round(fig["model_state_bytes"] / 1e6, 2) or None})
    print(f"world {args.world}, gloo, GPT-2 hidden {args.hidden} x {args.layers} layers, vocab {args.vocab}, "
          f"seq {args.seq}, batch {args.batch}/rank, fp32 AdamW, {args.steps} timed steps (median)")
    print(f"{'variant':<15} {'step s':>8} {'x DDP':>7} {'model states MB/rank':>22}")
    for r in rows:
        mb = r["model_state_MB_rank0"]
        print(f"{r['variant']:<15} {r['median_step_s']:>8.4f} {r['ratio_vs_ddp']:>7.3f} "
              f"{'(not measured)' if mb is None else f'{mb:.2f}':>22}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
