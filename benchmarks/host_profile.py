"""Where the engine's host time goes per step, by hfzero function (cProfile on the host proxy's workload).

Runs the systems of ``benchmarks/host_proxy.py`` (same model, fake world, dtype) under cProfile for
``--steps`` steps after ``--warmup`` unprofiled ones, and attributes the time to hfzero's functions: a
function's **own** time is its self time plus the time of everything outside hfzero it calls directly
(torch ops, the inner optimizer's step, Python builtins), so hfzero's functions' own times add up to the
host time spent because of hfzero, without counting a time twice. Code outside hfzero that calls no hfzero
function (the model's forward, autograd's own work) is the rest of the step, shared with the plain loop.
Times are process CPU seconds (the process runs one thread by default). cProfile slows Python code (a few microseconds per call), so the absolute figures exceed the unprofiled
step; the shares and the calls per step are what to compare. Usage:

    python benchmarks/host_profile.py [--systems plain,zero0,zero1,zero2,zero3] [--steps 20] [--top 20]
        [--world 8] [--dtype bf16] [--json OUT]
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import sys
import time
from typing import Any

import hfzero
from hfzero.testing import run_fake_rank

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from host_proxy import build  # noqa: E402  (a sibling script: same workload)

import torch  # noqa: E402

_ROOT = os.path.dirname(os.path.abspath(hfzero.__file__))


def _is_ours(func: tuple[str, int, str]) -> bool:
    return func[0].startswith(_ROOT)


def _label(func: tuple[str, int, str]) -> str:
    return f"{os.path.relpath(func[0], _ROOT)}:{func[2]}"


def attribute(stats: pstats.Stats, steps: int) -> dict[str, Any]:
    """Own time per hfzero function (self time plus the non-hfzero callees' inclusive time), per step."""
    table = stats.stats  # func -> (primitive calls, calls, self s, inclusive s, callers {func: (pc, nc, tt, ct)})
    own: dict[tuple[str, int, str], float] = {f: v[2] for f, v in table.items() if _is_ours(f)}
    calls = {f: table[f][1] for f in own}
    for callee, (_, _, _, _, callers) in table.items():
        if _is_ours(callee):
            continue
        for caller, (_, _, _, inclusive) in callers.items():
            if caller in own:
                own[caller] += inclusive
    total = sum(v[2] for v in table.values())
    rows = sorted(own, key=own.get, reverse=True)
    return {"step_ms": 1e3 * total / steps, "hfzero_ms": 1e3 * sum(own.values()) / steps,
            "functions": [{"function": _label(f), "calls": calls[f] / steps, "own_us": 1e6 * own[f] / steps}
                          for f in rows if own[f] > 0]}


def profile(rank: int, world: int, args: argparse.Namespace) -> dict[str, Any]:
    del rank, world
    tokens = torch.randint(0, args.vocab, (1, args.tokens), generator=torch.Generator().manual_seed(0))  # (1, T)
    out = {}
    for name in args.systems.split(","):
        step = build(name, args)
        for _ in range(args.warmup):
            step(tokens)
        profiler = cProfile.Profile(time.process_time)  # CPU time: steadier than wall time on a shared machine
        profiler.enable()
        for _ in range(args.steps):
            step(tokens)
        profiler.disable()
        out[name] = attribute(pstats.Stats(profiler), args.steps)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--systems", default="plain,zero0,zero1,zero2,zero3")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--top", type=int, default=20, help="functions listed per system")
    parser.add_argument("--world", type=int, default=8)
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--hidden", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=8)
    parser.add_argument("--persistence", type=int, default=1000)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", help="write the report here")
    args = parser.parse_args()
    args.compile = "none"
    report = run_fake_rank(profile, args.world, args, threads=args.threads, timeout=3600)
    print(f"host profile: rank 0 of a fake world of {args.world}, {args.dtype}, {args.steps} profiled steps; "
          f"load average {os.getloadavg()[0]:.1f}")
    for name, result in report.items():
        print(f"\n{name}: {result['step_ms']:.1f} ms/step profiled, {result['hfzero_ms']:.1f} ms of it in hfzero "
              f"functions (own time)")
        if result["functions"]:
            print(f"  {'function':60} {'calls/step':>10} {'own us/step':>12}")
        for row in result["functions"][:args.top]:
            print(f"  {row['function']:60} {row['calls']:10.1f} {row['own_us']:12.0f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"settings": vars(args), "systems": report}, f, indent=2)


if __name__ == "__main__":
    main()
