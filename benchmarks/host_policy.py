"""The CPU host-allocator policy side by side with DDP: step time AND per-rank peak RSS for every
choice (see [Note: host allocator] in hfzero/runtime/hostmem.py).

Each variant runs in processes of its own (the policy is process-wide: a variant sharing a process
with DDP would slow DDP too), as users run them; variants are started in interleaved rounds (all
variants once, then again), and each round's step time is divided by the same round's DDP run, so
a drift of the machine's speed hits both sides of a ratio alike. Reported per variant: median over
rounds of (step time / DDP's), of the per-rank peak RSS (VmHWM of the whole process, the worse rank)
divided by DDP's, and the peak's growth from step 2 to the last step (flatness).

A variant is ``ddp`` or ``zeroS`` (hfzero stage S, default config), optionally followed by
``:field=value,...`` ZeroConfig overrides, e.g. ``zero1:host_mmap_threshold=1048576,host_trim=True`` or
``zero3:stage3_buffers=mapped``. Shapes: ``bars`` (GPT-2
4 x 256, vocab 8192, batch 8 x 128 per rank, one backward per step: the side-by-side benchmark's) and
``accum`` (the same model, batch 2 x 64, 4 micro-batches per step under no_sync: the case that
motivated the trim).

    python benchmarks/host_policy.py [--shape bars] [--rounds 3] [--steps 12] [VARIANT ...]
    python benchmarks/host_policy.py --shape accum ddp zero3 zero3:host_mmap_threshold=1048576,host_trim=True \
        zero3:host_mmap_threshold=33554432,host_trim=True,host_trim_slack=0.02
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

import hfzero
from hfzero.testing import run_distributed
from hfzero.testing.models import tiny_causal_lm
from hfzero.testing.procmem import status

VOCAB = 8192
SHAPES = {"bars": {"batch": 8, "seq": 128, "micro": 1}, "accum": {"batch": 2, "seq": 64, "micro": 4}}
LOWEST = "host_mmap_threshold=1048576,host_trim=True"
"""The lowest-peak policy (the default before issue 21): 1 MiB fixed threshold, trim after every step."""
FAST = "host_mmap_threshold=33554432,host_trim=True,host_trim_slack=0.02"
"""32 MiB fixed threshold, no automatic top trim, heap trimmed when the RSS grew past 2%."""
DEFAULT_VARIANTS = ["ddp", *(f"zero{s}{spec}" for s in range(4) for spec in ("", f":{LOWEST}", f":{FAST}"))]


def _build(variant: str):
    model = tiny_causal_lm("gpt2", hidden=256, layers=4, vocab=VOCAB, positions=128)  # 5.3M parameters
    name, _, spec = variant.partition(":")
    if name == "ddp":
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        return ddp, torch.optim.AdamW(ddp.parameters(), lr=1e-4), False
    overrides = dict(item.split("=", 1) for item in filter(None, spec.split(",")))
    config = hfzero.ZeroConfig.from_strings({"stage": name.removeprefix("zero"), **overrides})  # typed per field
    model, optimizer = hfzero.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-4), config)
    return model, optimizer, True


def worker(rank: int, world: int, variant: str, shape: str, steps: int) -> dict[str, Any]:
    batch, seq, micro = SHAPES[shape]["batch"], SHAPES[shape]["seq"], SHAPES[shape]["micro"]
    model, optimizer, zero = _build(variant)
    generator = torch.Generator().manual_seed(rank)
    times, cpu, faults, peaks = [], [], [], []
    for _ in range(steps):
        dist.barrier()
        start, usage = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
        for index in range(micro):
            ids = torch.randint(0, VOCAB, (batch, seq), generator=generator)  # (B, T) per rank
            loss = model(input_ids=ids, labels=ids).loss / micro
            if index < micro - 1:
                with (optimizer.no_sync() if zero else model.no_sync()):
                    loss.backward()
            else:
                loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        dist.barrier()
        times.append(time.perf_counter() - start)
        now = resource.getrusage(resource.RUSAGE_SELF)
        cpu.append(now.ru_utime + now.ru_stime - usage.ru_utime - usage.ru_stime)
        faults.append(now.ru_minflt - usage.ru_minflt)
        peaks.append(status("VmHWM"))
    heap = getattr(optimizer, "heap", None)
    return {"step": statistics.median(times[2:]), "cpu": statistics.median(cpu[2:]),
            "faults": statistics.median(faults[2:]), "peak": peaks[-1], "growth": peaks[-1] / peaks[1],
            "trims": heap.trims if heap is not None else 0}


def _child(variant: str, args: argparse.Namespace) -> dict[str, Any]:
    """One variant in processes of its own; its result as the child prints it (one JSON line)."""
    command = [sys.executable, __file__, "--child", variant, "--shape", args.shape, "--steps", str(args.steps),
               "--world", str(args.world)]
    done = subprocess.run(command, capture_output=True, text=True, check=False, env=os.environ.copy())
    if done.returncode != 0:
        raise RuntimeError(f"{variant} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("variants", nargs="*", default=DEFAULT_VARIANTS)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="bars")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--json", help="also write every run's figures to this JSON file")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        ranks = run_distributed(worker, args.world, args.child, args.shape, args.steps, timeout=1800)
        print(json.dumps({key: max(r[key] for r in ranks) for key in ranks[0]}))
        return
    variants = args.variants if args.variants[0] == "ddp" else ["ddp", *args.variants]
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
    for round_index in range(args.rounds):
        for variant in variants:
            runs[variant].append(_child(variant, args))
            print(f"round {round_index + 1} {variant}: {runs[variant][-1]}", file=sys.stderr, flush=True)
    shape = SHAPES[args.shape]
    print(f"GPT-2 4 x 256 (5.3M), vocab {VOCAB}, batch {shape['batch']} x {shape['seq']} per rank, "
          f"{shape['micro']} micro-batch(es) per step, world {args.world} gloo, fp32 AdamW, {args.steps} steps; "
          f"{args.rounds} interleaved rounds, each variant in its own processes; load: {os.getloadavg()[0]:.2f}")
    print("step: wall time of a step (slowest rank); cpu: its CPU seconds (user + system, the busier rank: less "
          "sensitive to a loaded machine); faults: minor page faults per step; growth: peak after the last step / "
          "after step 2; every 'x DDP' is the median over rounds of the ratio to the same round's DDP run")
    print(f"{'variant':<52} {'step ms':>8} {'x DDP':>6} {'cpu ms':>7} {'x DDP':>6} {'faults':>7} "
          f"{'peak MB':>8} {'x DDP':>6} {'growth':>6} {'trims':>5}")
    ddp = runs["ddp"]

    def med(rows: list[dict[str, Any]], key: str, ratio: bool = False) -> float:
        return statistics.median(r[key] / d[key] if ratio else r[key] for r, d in zip(rows, ddp))

    for variant, rows in runs.items():
        print(f"{variant:<52} {1000 * med(rows, 'step'):>8.0f} {med(rows, 'step', True):>6.3f} "
              f"{1000 * med(rows, 'cpu'):>7.0f} {med(rows, 'cpu', True):>6.3f} {med(rows, 'faults'):>7.0f} "
              f"{med(rows, 'peak') / 1e6:>8.0f} {med(rows, 'peak', True):>6.3f} {max(r['growth'] for r in rows):>6.3f} "
              f"{max(r['trims'] for r in rows):>5}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"args": vars(args), "runs": runs}, f, indent=2)


if __name__ == "__main__":
    main()
