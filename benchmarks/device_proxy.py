"""Device-work proxy: the aten ops one steady-state training step dispatches and the bytes they read and write.

On a GPU, what the engine adds to a step beyond host work is device work: bytes moved and kernels launched
(gradient copies into buckets, the fp32 master's conversions and update, the cast back to 16-bit parameters,
per-bucket small kernels). This script counts them on CPU: one step after ``--warmup`` steps (optimizer states
exist, pools are warm) runs under ``hfzero.testing.census.Census``, a ``TorchDispatchMode`` that records every
aten op with the bytes it reads and writes and the **site** that dispatched it (the innermost hfzero function:
the engine's passes by name; ``optimizer``; ``model``); the rules are in that module's docstring.

Systems: ``plain_amp``, the Trainer's recipe (fp32 weights under ``torch.autocast`` in ``--dtype``, AdamW with
``--optim``, ``zero_grad(set_to_none=True)``); with ``--pure`` also ``plain``, the model in ``--dtype`` with the
same AdamW (its model site's bytes, subtracted from plain_amp's, are autocast's casts); ``zeroN`` (``--stages``),
``hfzero.prepare`` at stage N with ``ZeroConfig(dtype=--dtype)`` and the same AdamW. One process acts as rank 0
of a fake world of ``--world`` ranks (1 by default, as the first GPU run). The default model is GPT-2 124M's
shape scaled down 8 times in width, vocabulary and tokens (hidden 96, 12 layers, vocab 6282, 1 x 512 tokens
against 768, 12, 50257 and 8 x 512): weights scale with width squared and activations with tokens times width,
so the bytes of the model's compute and of the parameters keep the GPU run's proportions. Reported per system:
bytes read + written per step and x plain_amp, kernels (ops that move bytes), bytes per parameter element (B/Ψ)
in all and outside the model (the engine), and the minimum for the stage (``minimum_bytes``); then the sites,
with ``--ops`` their op kinds. docs/engine.md ("Device-work proxy") names every pass the engine makes over a flat
buffer that the plain loop does not make, with its reason.

    python benchmarks/device_proxy.py [--stages 0,1,2] [--world 1] [--pure] [--dtype bf16] [--optim fused]
        [--hidden 96] [--layers 12] [--vocab 6282] [--batch 1] [--seq 512] [--ops] [--json OUT]
"""

from __future__ import annotations

import argparse
import contextlib
import json
from typing import Any

import torch

import hfzero
from hfzero.testing import run_fake_rank
from hfzero.testing.census import Census, by_site, kernel_ops, total_bytes
from hfzero.testing.models import tiny_causal_lm
from hfzero.testing.workloads import param_groups

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _build(system: str, args: argparse.Namespace):
    """A step function and the number of trainable parameters of ``system``."""
    dtype = DTYPES[args.dtype]
    model = tiny_causal_lm("gpt2", hidden=args.hidden, layers=args.layers, vocab=args.vocab,
                           positions=max(64, args.seq))
    numel = sum(p.numel() for p in model.parameters())
    optim = {"fused": {"fused": True}, "foreach": {"foreach": True}, "for-loop": {"foreach": False}}[args.optim]
    context: Any = contextlib.nullcontext
    zero = None
    if system == "plain_amp":
        optimizer = torch.optim.AdamW(param_groups(model), lr=1e-4, **optim)
        if dtype != torch.float32:
            context = lambda: torch.autocast("cpu", dtype=dtype)  # noqa: E731
    elif system == "plain":
        model.to(dtype)
        optimizer = torch.optim.AdamW(param_groups(model), lr=1e-4, **optim)
    else:
        config = hfzero.ZeroConfig(stage=int(system.removeprefix("zero")), dtype=args.dtype)
        model, optimizer = hfzero.prepare(model, torch.optim.AdamW(param_groups(model), lr=1e-4, **optim), config)
        zero = optimizer
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)  # (B, T)

    def step() -> None:
        with context():
            loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    del zero
    return step, numel


def census(rank: int, world: int, args: argparse.Namespace) -> dict[str, Any]:
    del rank, world
    out = {}
    for system in systems_of(args):
        step, numel = _build(system, args)
        for _ in range(args.warmup):
            step()
        mode = Census()
        with mode:
            step()
        out[system] = {"params": numel, "rows": mode.table()}
        del step
    return out


def systems_of(args: argparse.Namespace) -> list[str]:
    return ["plain_amp", *(["plain"] if args.pure else []), *(f"zero{s}" for s in args.stages.split(",") if s)]


def minimum_bytes(stage: int, world: int) -> float:
    """Bytes per parameter element a step of ``stage`` must move beyond the model's own compute, with 16-bit
    gradients and torch's fused fp32 AdamW: the gradients into flat buckets (read 2, write 2; any bucketed
    reduction, DDP's too), and on the rank's 1/N of the elements (all of them at stage 0) the conversion of
    the 16-bit gradient sum to fp32 (2 + 4), the update (reads parameter, gradient and two moments, writes
    three: 28) and the cast back to the 16-bit parameter (4 + 2). The plain loop's Trainer recipe moves 40:
    autocast's cast of each weight in forward (4 + 2) and of its gradient in backward (2 + 4), and the same
    update (28). A fused mixed-precision kernel (16-bit gradient in, 16-bit parameter out) would need 28 / N."""
    shard = 1 if stage == 0 else world
    return 4 + (6 + 28 + 6) / shard


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", default="0,1,2")
    parser.add_argument("--pure", action="store_true", help="also count a pure 16-bit plain loop")
    parser.add_argument("--world", type=int, default=1, help="ranks of the fake world (this process is rank 0)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--optim", choices=["fused", "foreach", "for-loop"], default="fused",
                        help="AdamW implementation of every system (the Trainer's default is fused)")
    parser.add_argument("--hidden", type=int, default=96)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=6282)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: all cores)")
    parser.add_argument("--ops", action="store_true", help="list the op kinds of every site")
    parser.add_argument("--json", help="write the report here")
    args = parser.parse_args()
    report = run_fake_rank(census, args.world, args, threads=args.threads or None, timeout=3600)
    numel = report["plain_amp"]["params"]
    base = total_bytes(report["plain_amp"]["rows"])
    base_model = by_site(report["plain_amp"]["rows"]).get("model", {"read": 0, "written": 0})
    print(f"device proxy: GPT-2 hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}, {args.batch} x "
          f"{args.seq} tokens, {args.dtype}, AdamW {args.optim}, rank 0 of a world of {args.world}; "
          f"Ψ = {numel / 1e6:.2f}M; one step after {args.warmup}")
    print("B/Ψ: bytes per parameter element; engine: every site but 'model' (plain_amp: the optimizer and "
          "autocast's casts, counted against plain when --pure)")
    print(f"{'system':10} {'MB r+w':>9} {'x plain_amp':>12} {'kernels':>8} {'B/Ψ':>7} {'engine B/Ψ':>11} "
          f"{'minimum B/Ψ':>12}")
    summaries = {}
    for system, result in report.items():
        rows = result["rows"]
        sites = by_site(rows)
        engine = sum(v["read"] + v["written"] for k, v in sites.items() if k != "model")
        if system == "plain_amp" and "plain" in report:  # autocast's casts: the model site's excess over plain's
            plain_model = by_site(report["plain"]["rows"]).get("model", {"read": 0, "written": 0})
            engine += (base_model["read"] + base_model["written"]) - (plain_model["read"] + plain_model["written"])
        total = total_bytes(rows)
        minimum = minimum_bytes(int(system[-1]), args.world) if system.startswith("zero") else None
        summaries[system] = {"bytes": total, "x_plain_amp": total / base, "kernels": kernel_ops(rows),
                             "bytes_per_param": total / numel, "engine_bytes_per_param": engine / numel,
                             "minimum_bytes_per_param": minimum, "sites": sites}
        print(f"{system:10} {total / 1e6:9.1f} {total / base:12.3f} {kernel_ops(rows):8d} {total / numel:7.1f} "
              f"{engine / numel:11.1f} {'' if minimum is None else f'{minimum:.1f}':>12}")
    for system, result in report.items():
        print(f"\n{system}: by site (MB read, MB written, ops, B/Ψ)")
        for site, s in sorted(summaries[system]["sites"].items(), key=lambda kv: -(kv[1]["read"] + kv[1]["written"])):
            print(f"  {site:48} {s['read'] / 1e6:9.2f} {s['written'] / 1e6:9.2f} {s['ops']:6d} "
                  f"{(s['read'] + s['written']) / numel:7.2f}")
            if args.ops:
                for row in sorted((r for r in result["rows"] if r["site"] == site),
                                  key=lambda r: -(r["read"] + r["written"])):
                    if row["read"] + row["written"] or row["op"].startswith("c10d."):
                        print(f"      {row['op']:44} {row['read'] / 1e6:9.2f} {row['written'] / 1e6:9.2f} "
                              f"{row['ops']:6d}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"settings": vars(args), "systems": report, "summaries": summaries}, f, indent=2)


if __name__ == "__main__":
    main()
