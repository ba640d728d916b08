"""torch.compile's effect on step time: DDP and hfzero stages 0-3, eager and compiled, in one process group.

Every system (DDP, hfzero stages 0-3; each eager and compiled) is built in the same 2-rank gloo group
and they are stepped in interleaved rounds (one step of each, in turn), so machine noise hits them alike.
Compiled DDP is ``torch.compile(ddp_model)`` (dynamo's DDPOptimizer splits the graph at bucket
boundaries); compiled hfzero is ``hfzero.compile_regions`` after ``prepare`` (``--how whole``:
``torch.compile(model)``). Reported per model: median step time (the busier rank) after the warm-up steps,
compiled / eager per system, hfzero compiled / DDP compiled (``--clock cpu``: the busier rank's process CPU
seconds instead of wall seconds, for a machine shared with other work), the first step's time (compilation
included), graph breaks counted by dynamo while each system compiled, and frames compiled again after
the warm-up (recompiles: should be 0). ``--how both`` builds hfzero regional and whole side by side (one eager
system per stage, two compiled), so the two compilations are compared in the same run. Usage:

    python benchmarks/compile.py [--models gpt2,llama] [--hidden 384] [--layers 6] [--vocab 8192]
        [--seq 128] [--batch 4] [--steps 8] [--warmup 2] [--backend inductor] [--how regional|whole|both] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch

import hfzero
from hfzero.testing import run_distributed
from hfzero.testing.models import tiny_causal_lm, token_batches

SYSTEMS = ["ddp", "zero0", "zero1", "zero2", "zero3"]


def _build(system: str, mode: str, kind: str, args: argparse.Namespace) -> tuple[Any, Any, Any]:
    """(callable model, model with no_sync/parameters, optimizer) for one system; ``mode``: eager, regional or
    whole (DDP compiles whole either way)."""
    model = tiny_causal_lm(kind, hidden=args.hidden, layers=args.layers, vocab=args.vocab, positions=args.seq)
    options = {"backend": args.backend} if args.backend != "inductor" else {}
    if system == "ddp":
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-4)
        return (ddp if mode == "eager" else torch.compile(ddp, **options)), ddp, optimizer
    config = hfzero.ZeroConfig(stage=int(system.removeprefix("zero")))
    model, optimizer = hfzero.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-4), config)
    if mode == "eager":
        return model, model, optimizer
    if mode == "whole":
        return torch.compile(model, **options), model, optimizer
    return hfzero.compile_regions(model, **options), model, optimizer


def _modes(system: str, args: argparse.Namespace) -> list[str]:
    """The modes a system is built in: eager, and hfzero's compilation(s) (``--how both``: regional and whole)."""
    if system == "ddp":
        return ["eager", "whole"]
    return ["eager", *(["regional", "whole"] if args.how == "both" else [args.how])]


def _counts() -> tuple[int, int]:
    from torch._dynamo.utils import counters

    return sum(counters["graph_break"].values()), counters["frames"]["ok"]


def _bench(rank: int, world: int, args: argparse.Namespace) -> dict[str, Any]:
    import torch._dynamo

    torch._dynamo.config.recompile_limit = 64  # ten systems share the cache: none may hit the limit
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    report: dict[str, Any] = {}
    for kind in args.models.split(","):
        torch._dynamo.reset()
        systems = {(s, m): _build(s, m, kind, args) for s in SYSTEMS for m in _modes(s, args)}
        times: dict[tuple[str, bool], list[float]] = {key: [] for key in systems}
        breaks = {key: 0 for key in systems}
        late_frames = {key: 0 for key in systems}
        batches = token_batches(args.steps, args.batch * world, args.seq, vocab=args.vocab)
        for step, batch in enumerate(batches):
            x = batch.chunk(world)[rank]
            for key, (forward, _, optimizer) in systems.items():
                before = _counts()
                torch.distributed.barrier()
                start = clock()
                forward(input_ids=x, labels=x).loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                times[key].append(clock() - start)
                after = _counts()
                breaks[key] += after[0] - before[0]
                if step >= args.warmup:
                    late_frames[key] += after[1] - before[1]
        # the busier rank's time of each step (one all-reduce, at the same point on every rank)
        table = torch.tensor([times[key] for key in systems], dtype=torch.float64)
        torch.distributed.all_reduce(table, op=torch.distributed.ReduceOp.MAX)
        times = {key: table[i].tolist() for i, key in enumerate(systems)}
        median = {key: statistics.median(t[args.warmup:]) for key, t in times.items()}
        rows = {}
        for system in SYSTEMS:
            eager = median[(system, "eager")]
            for mode in _modes(system, args)[1:]:
                compiled = median[(system, mode)]
                name = system if args.how != "both" or system == "ddp" else f"{system} {mode}"
                rows[name] = {
                    "eager_ms": 1e3 * eager, "compiled_ms": 1e3 * compiled, "compiled_over_eager": compiled / eager,
                    "compiled_over_ddp_compiled": compiled / median[("ddp", "whole")],
                    "first_step_s": times[(system, mode)][0], "graph_breaks": breaks[(system, mode)],
                    "recompiles_after_warmup": late_frames[(system, mode)],
                }
        params = sum(p.numel() for p in tiny_causal_lm(kind, hidden=args.hidden, layers=args.layers,
                                                       vocab=args.vocab, positions=args.seq).parameters())
        report[kind] = {"parameters": params, "systems": rows}
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="gpt2,llama")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=384)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank per step")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2, help="steps left out of the medians (compilation)")
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--how", choices=["regional", "whole", "both"], default="regional",
                        help="hfzero's compilation: compile_regions (default), torch.compile(model), or both side by "
                             "side in the same run")
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                        help="step time as wall seconds (default) or process CPU seconds (all threads; a machine "
                             "shared with other work); either way the busier rank's")
    parser.add_argument("--json", help="write the report here")
    args = parser.parse_args()
    if args.steps <= args.warmup:
        parser.error("--steps must exceed --warmup")
    report = run_distributed(_bench, args.world, args, timeout=3600)[0]
    report["settings"] = vars(args)
    for kind, result in report.items():
        if kind == "settings":
            continue
        print(f"{kind} ({result['parameters'] / 1e6:.1f}M parameters), {args.world} ranks, backend {args.backend}, "
              f"hfzero {args.how}, {args.clock} clock (the busier rank)")
        print(f"{'system':14} {'eager ms':>9} {'compiled ms':>12} {'comp/eager':>11} {'/ddp comp':>10} "
              f"{'1st step s':>11} {'breaks':>7} {'recompiles':>11}")
        for system, row in result["systems"].items():
            print(f"{system:14} {row['eager_ms']:9.1f} {row['compiled_ms']:12.1f} {row['compiled_over_eager']:11.3f} "
                  f"{row['compiled_over_ddp_compiled']:10.3f} {row['first_step_s']:11.1f} {row['graph_breaks']:7d} "
                  f"{row['recompiles_after_warmup']:11d}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
