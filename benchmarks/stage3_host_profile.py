"""Where stage 3's host time goes per training step, by hfzero function, beside stage 2 (issue 34).

The host proxy's model and world (GPT-2, hidden 32, 24 layers, one sequence of 8 tokens; rank 0 of a fake
world of ``--world`` ranks on torch's fake process group, so every per-unit step runs and no collective
moves anything: see benchmarks/host_proxy.py) is prepared at stages 2 and 3 and each is stepped under cProfile. Every
profiled second is charged to the innermost hfzero function on the stack at that moment: a function's
own Python lines plus what it calls in torch or the standard library, minus what it calls in other hfzero
functions (which are charged themselves). Time with no hfzero function on the stack (the model's own
forward, autograd's C++ engine outside hfzero's hooks, the optimizer's kernels) is one row, "outside
hfzero". The profiler's clock is the process's CPU time (a loaded machine's
waits are not charged). cProfile adds a cost per Python call, so the profiled milliseconds are larger
than the unprofiled step; compare rows and runs, not absolute times. The unprofiled CPU time per step of stages 2
and 3 and of a plain bf16 loop (torch AdamW, foreach) in the same process is printed above the table, as
the median over ``--rounds`` interleaved rounds.

    python benchmarks/stage3_host_profile.py [--steps 20] [--rounds 5] [--world 8] [--persistence 1000]
        [--top 25] [--json OUT]
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import os
import pstats
import statistics
import time
from typing import Any

import torch

import hfzero
from hfzero.testing import run_fake_rank
from hfzero.testing.models import tiny_causal_lm
from hfzero.testing.workloads import param_groups

OUTSIDE = "outside hfzero"


def _build(system: str, args: argparse.Namespace):
    model = tiny_causal_lm("gpt2", hidden=args.hidden, layers=args.layers, vocab=args.vocab,
                           positions=max(64, args.tokens))
    if system == "plain":
        model.to(torch.bfloat16)
        optimizer = torch.optim.AdamW(param_groups(model), lr=1e-4, foreach=True)
    else:
        stage = int(system.removeprefix("stage"))
        extra = {"param_persistence_threshold": args.persistence} if stage == 3 else {}
        config = hfzero.ZeroConfig(stage=stage, dtype="bf16", **extra)
        model, optimizer = hfzero.prepare(model, torch.optim.AdamW(param_groups(model), lr=1e-4), config)
    tokens = torch.randint(0, args.vocab, (1, args.tokens), generator=torch.Generator().manual_seed(0))  # (1, T)

    def step() -> None:
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    return step


def _is_hfzero(func: tuple[str, int, str]) -> bool:
    return f"{os.sep}hfzero{os.sep}" in func[0]


def _label(func: tuple[str, int, str]) -> str:
    path = func[0]
    rel = path[path.rindex(f"{os.sep}hfzero{os.sep}") + 1:]
    return f"{rel}:{func[2]}"


def charge(stats: pstats.Stats) -> dict[str, dict[str, float]]:
    """Seconds and calls per hfzero function, each charged with its own time and its non-hfzero callees'
    (see the module docstring); the rest as OUTSIDE."""
    table = stats.stats  # func -> (primitive calls, calls, own seconds, cumulative seconds, callers)
    rows: dict[str, dict[str, float]] = {}
    total = sum(tt for _, _, tt, _, _ in table.values())
    charged = 0.0
    for func, (_, calls, own, cumulative, _) in table.items():
        if not _is_hfzero(func):
            continue
        # what this function's calls into other hfzero functions cost (those are charged to them)
        inner = sum(edge[3] for callee, (_, _, _, _, callers) in table.items() if _is_hfzero(callee)
                    for caller, edge in callers.items() if caller == func and callee != func)
        seconds = max(0.0, cumulative - inner)
        row = rows.setdefault(_label(func), {"seconds": 0.0, "calls": 0})
        row["seconds"] += seconds
        row["calls"] += calls
        charged += seconds
    rows[OUTSIDE] = {"seconds": max(0.0, total - charged), "calls": 0}
    return rows


def profile(rank: int, world: int, args: argparse.Namespace) -> dict[str, Any]:
    del rank, world
    systems = {name: _build(name, args) for name in ("plain", "stage2", "stage3")}
    for step in systems.values():
        for _ in range(args.warmup):
            step()
    cpu: dict[str, list[float]] = {name: [] for name in systems}
    for round_index in range(args.rounds):
        names = list(systems) if round_index % 2 == 0 else list(systems)[::-1]
        for name in names:
            gc.collect()
            times = []
            for _ in range(args.steps):
                start = time.process_time()
                systems[name]()
                times.append(time.process_time() - start)
            cpu[name].append(statistics.median(times))
    profiles = {}
    for name in ("stage2", "stage3"):
        gc.collect()
        profiler = cProfile.Profile(time.process_time)  # CPU time: a loaded machine's waits are not charged
        profiler.enable()
        for _ in range(args.steps):
            systems[name]()
        profiler.disable()
        stats = pstats.Stats(profiler)
        profiles[name] = {
            "rows": {k: {"ms_per_step": 1e3 * v["seconds"] / args.steps, "calls_per_step": v["calls"] / args.steps}
                     for k, v in charge(stats).items()},
            "python_calls_per_step": sum(nc for _, nc, _, _, _ in stats.stats.values()) / args.steps}
    return {"cpu_ms": {name: 1e3 * statistics.median(v) for name, v in cpu.items()}, "profiles": profiles,
            "load": os.getloadavg()[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--world", type=int, default=8)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--hidden", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=8)
    parser.add_argument("--persistence", type=int, default=1000, help="stage 3's param_persistence_threshold")
    parser.add_argument("--top", type=int, default=25, help="rows shown (the rest summed)")
    parser.add_argument("--json", help="also write the report here")
    args = parser.parse_args()
    report = run_fake_rank(profile, args.world, args, threads=1, timeout=3600)
    cpu = report["cpu_ms"]
    print(f"stage 3 host profile: GPT-2 hidden {args.hidden}, {args.layers} layers, 1 x {args.tokens} tokens, bf16, "
          f"rank 0 of a fake world of {args.world}, persistence {args.persistence}; load average {report['load']:.1f}")
    print(f"unprofiled CPU ms per step (median of {args.rounds} rounds x {args.steps} steps): plain {cpu['plain']:.2f}, "
          f"stage 2 {cpu['stage2']:.2f} ({cpu['stage2'] / cpu['plain']:.3f} x plain), "
          f"stage 3 {cpu['stage3']:.2f} ({cpu['stage3'] / cpu['plain']:.3f} x plain)")
    two, three = report["profiles"]["stage2"], report["profiles"]["stage3"]
    print(f"profiled Python calls per step: stage 2 {two['python_calls_per_step']:.0f}, "
          f"stage 3 {three['python_calls_per_step']:.0f}")
    rows = sorted(three["rows"].items(), key=lambda kv: -kv[1]["ms_per_step"])
    total = sum(r["ms_per_step"] for _, r in rows)
    total2 = sum(r["ms_per_step"] for r in two["rows"].values())
    print(f"{'function (innermost hfzero frame)':56} {'stage 3 ms':>10} {'share':>6} {'calls':>7} "
          f"{'stage 2 ms':>10} {'calls':>7}")
    shown, rest = rows[:args.top], rows[args.top:]
    for name, row in shown:
        other = two["rows"].get(name, {"ms_per_step": 0.0, "calls_per_step": 0.0})
        print(f"{name:56} {row['ms_per_step']:10.2f} {row['ms_per_step'] / total:6.1%} {row['calls_per_step']:7.1f} "
              f"{other['ms_per_step']:10.2f} {other['calls_per_step']:7.1f}")
    if rest:
        ms = sum(r["ms_per_step"] for _, r in rest)
        ms2 = sum(two["rows"].get(name, {"ms_per_step": 0.0})["ms_per_step"] for name, _ in rest)
        print(f"{f'({len(rest)} more)':56} {ms:10.2f} {ms / total:6.1%} {'':7} {ms2:10.2f}")
    print(f"{'profiled total':56} {total:10.2f} {'':6} {'':7} {total2:10.2f}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"settings": vars(args), **report}, f, indent=2)


if __name__ == "__main__":
    main()
