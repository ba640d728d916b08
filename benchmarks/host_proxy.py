"""Host-overhead proxy: the engine's own per-step host cost on CPU, as a ratio to a plain loop.

A deep model with negligible arithmetic (GPT-2, hidden 32, 24 layers, one sequence of 8 tokens) makes a
training step nearly all host work: Python hooks, per-bucket and per-unit bookkeeping, kernel launches.
The process is rank 0 of a fake world of ``--world`` ranks (torch's fake process group: every collective
returns at once and moves nothing), so every per-bucket and per-unit step of a sharded engine runs as it
would at that world size while nothing is communicated: what is timed is the engine, not the network.
On a fast GPU a small model's step is short and this host work shows directly in step time (issue 34;
the first GPU run's figures are in docs/engine.md, "Host-overhead proxy").

Systems, all built in the one process and stepped in interleaved rounds (each round runs ``--steps``
steps of every system in turn, the order rotated from round to round, so machine noise hits them alike):
- ``plain``: the reference. The model in ``--dtype`` (pure bf16 by default: no fp32 master copy) with
  torch AdamW (``foreach=True``); no process group involved.
- ``plain_amp`` (opt-in, ``--baselines``): the Trainer's recipe, fp32 weights under ``torch.autocast``
  in ``--dtype``, AdamW (``foreach=True``).
- ``fsdp2``: ``fully_shard`` per decoder block and on the root over the fake world's mesh, as torchtitan
  and the FSDP2 docs recommend: ``MixedPrecisionPolicy(param_dtype=--dtype, reduce_dtype=float32)`` over
  fp32 weights, blocks resharded after forward except the last (backward needs it at once), the root
  left to FSDP2's default; AdamW (``foreach=True``) over the DTensor shards.
- ``zeroN`` (``--stages``): ``hfzero.prepare`` at stage N with ``ZeroConfig(dtype=--dtype)``, AdamW over
  the two param groups a Trainer builds (the CPU engine steps it with torch's fused kernel,
  runtime/host_step.py). Stage 3 keeps parameters below ``--persistence`` elements whole: the default 1000
  gathers every matrix (wte and wpe included) and keeps every vector whole, the split the default
  threshold (100k) makes on GPT-2 124M, whose step the first GPU run timed. ``--stage3-buffers`` lists the
  unit buffers' backings to run ([Note: stage-3 gather buffers]; ``ZeroConfig.stage3_buffers``): "default"
  (system ``zero3``: "resized", a CUDA rank's path too) and "mapped" (``zero3-mapped``, opt-in on Linux CPU
  ranks: a ``madvise`` per release, a page fault per page per gather).

Every system runs ``loss.backward()`` as an ordinary script does. Reported per system: the median over
rounds of the round's median step (wall ms and process CPU ms), and the median over rounds of the ratio
to ``plain``'s step in the same round, with its range over rounds. The default, 100 rounds of one step
each, alternates the systems step by step: on this project's shared 2-core VM the speed drifts by tens
of percent within seconds (the same plain step measured 41 and 70 ms in two runs minutes apart), and rounds
of 5 steps per system (the former default, 7 rounds) put whole rounds of one system in a slow spell: their
medians moved by +-0.1 from run to run (zero2 0.94-1.16 x plain in three runs within ten minutes), while
ratios of adjacent steps hold to about +-0.01 (zero2 0.985 and 0.990, stage 3 1.164 and 1.165 in two runs). ``--compile regional`` compiles the
decoder blocks of every system (``hfzero.compile_regions``, before ``fully_shard`` for FSDP2) and warms
each up before the rounds. The load average is printed beside the figures: a loaded machine inflates
wall time; the CPU time of a one-thread process (``--threads 1``, default) is steadier there.

    python benchmarks/host_proxy.py [--rounds 100] [--steps 1] [--warmup 3] [--stages 0,1,2,3]
        [--baselines plain,fsdp2] [--world 8] [--dtype bf16] [--layers 24] [--hidden 32] [--tokens 8]
        [--persistence 1000] [--stage3-buffers default,mapped] [--compile none|regional] [--threads 1] [--json OUT]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

import hfzero
from hfzero.testing import run_fake_rank
from hfzero.testing.models import tiny_causal_lm
from hfzero.testing.spawn import run_distributed
from hfzero.testing.workloads import param_groups

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}
BASELINES = ("plain", "plain_amp", "fsdp2")


def _model(args: argparse.Namespace) -> torch.nn.Module:
    return tiny_causal_lm("gpt2", hidden=args.hidden, layers=args.layers, vocab=args.vocab,
                          positions=max(64, args.tokens))


def _compile(model: torch.nn.Module, args: argparse.Namespace) -> None:
    if args.compile == "regional":
        hfzero.compile_regions(model)


def build(system: str, args: argparse.Namespace) -> Callable[[torch.Tensor], None]:
    """One training step of ``system`` on a batch of token ids: forward, backward, step, zero_grad."""
    dtype = DTYPES[args.dtype]
    model = _model(args)
    context: Callable[[], Any] = contextlib.nullcontext
    if system == "plain":
        model.to(dtype)
        _compile(model, args)
        optimizer = torch.optim.AdamW(param_groups(model), lr=1e-4, foreach=True)
    elif system == "plain_amp":
        _compile(model, args)
        optimizer = torch.optim.AdamW(param_groups(model), lr=1e-4, foreach=True)
        if dtype != torch.float32:
            context = lambda: torch.autocast("cpu", dtype=dtype)  # noqa: E731
    elif system == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        _compile(model, args)
        mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
        policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
        blocks = list(model.transformer.h)
        for index, block in enumerate(blocks):
            fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=index < len(blocks) - 1)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        optimizer = torch.optim.AdamW(param_groups(model), lr=1e-4, foreach=True)
    elif system.startswith("zero"):
        stage, _, kind = system.removeprefix("zero").partition("-")
        stage = int(stage)
        extra = {"param_persistence_threshold": args.persistence} if stage == 3 else {}
        if kind:
            extra["stage3_buffers"] = kind
        config = hfzero.ZeroConfig(stage=stage, dtype=args.dtype, **extra)
        model, optimizer = hfzero.prepare(model, torch.optim.AdamW(param_groups(model), lr=1e-4), config)
        _compile(model, args)
    else:
        raise ValueError(f"unknown system {system!r}")

    def step(tokens: torch.Tensor) -> None:
        with context():
            loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    return step


def systems_of(args: argparse.Namespace) -> list[str]:
    """``plain`` first (the reference), then the other baselines, then the hfzero stages."""
    names = ["plain"] + [b for b in args.baselines.split(",") if b and b != "plain"]
    for stage in (s for s in args.stages.split(",") if s):
        if stage != "3":
            names.append(f"zero{stage}")
            continue
        names += [f"zero3-{kind}" if kind != "default" else "zero3" for kind in args.stage3_buffers.split(",")]
    return names


def bench(rank: int, world: int, args: argparse.Namespace) -> dict[str, Any]:
    """Build every system on this rank, warm each up, then time interleaved rounds."""
    del rank, world
    names = systems_of(args)
    steps = {name: build(name, args) for name in names}
    tokens = torch.randint(0, args.vocab, (1, args.tokens), generator=torch.Generator().manual_seed(0))  # (1, T)
    for name in names:
        for _ in range(args.warmup):
            steps[name](tokens)
    wall: dict[str, list[float]] = {n: [] for n in names}  # per round: the round's median step
    cpu: dict[str, list[float]] = {n: [] for n in names}
    loads = [os.getloadavg()[0]]
    for round_index in range(args.rounds):
        shift = round_index % len(names)
        gc.collect()  # once per round: with --steps 1 the systems' steps alternate back to back
        for name in names[shift:] + names[:shift]:
            w, c = [], []
            for _ in range(args.steps):
                w0, c0 = time.perf_counter(), time.process_time()
                steps[name](tokens)
                w.append(time.perf_counter() - w0)
                c.append(time.process_time() - c0)
            wall[name].append(statistics.median(w))
            cpu[name].append(statistics.median(c))
        loads.append(os.getloadavg()[0])
    rows = {}
    for name in names:
        ratios = [a / b for a, b in zip(wall[name], wall["plain"])]
        cpu_ratios = [a / b for a, b in zip(cpu[name], cpu["plain"])]
        rows[name] = {"wall_ms": 1e3 * statistics.median(wall[name]), "cpu_ms": 1e3 * statistics.median(cpu[name]),
                      "x_plain": statistics.median(ratios), "x_plain_min": min(ratios), "x_plain_max": max(ratios),
                      "cpu_x_plain": statistics.median(cpu_ratios), "rounds_wall_ms": [1e3 * t for t in wall[name]],
                      "rounds_cpu_ms": [1e3 * t for t in cpu[name]]}
    return {"systems": rows, "load": {"min": min(loads), "max": max(loads), "samples": loads}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--steps", type=int, default=1, help="timed steps of each system per round")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps of each system before the rounds")
    parser.add_argument("--stages", default="0,1,2,3", help="hfzero stages, comma-separated (empty: none)")
    parser.add_argument("--baselines", default="plain,fsdp2",
                        help=f"other systems beside plain, comma-separated, of {', '.join(BASELINES)}")
    parser.add_argument("--world", type=int, default=8, help="ranks of the fake world (this process is rank 0)")
    parser.add_argument("--backend", choices=["fake", "gloo"], default="fake",
                        help="fake: torch's fake process group; gloo: a real group (world 1 only)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--hidden", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=8, help="sequence length (batch 1)")
    parser.add_argument("--persistence", type=int, default=1000, help="stage 3's param_persistence_threshold")
    parser.add_argument("--stage3-buffers", default="default",
                        help="stage 3's unit-buffer backings, comma-separated, of default, mapped, resized (one "
                             "system each: zero3, zero3-mapped, zero3-resized)")
    parser.add_argument("--compile", choices=["none", "regional"], default="none")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--json", help="write the report here")
    args = parser.parse_args()
    unknown = [b for b in args.baselines.split(",") if b and b not in BASELINES]
    if unknown:
        parser.error(f"unknown baselines {unknown}; choose from {', '.join(BASELINES)}")
    kinds = [k for k in args.stage3_buffers.split(",") if k not in ("default", "mapped", "resized")]
    if kinds:
        parser.error(f"unknown --stage3-buffers {kinds}; choose from default, mapped, resized")
    if args.backend == "gloo" and args.world != 1:
        parser.error("--backend gloo runs one process: use --world 1")
    if args.compile == "regional" and args.warmup < 2:
        args.warmup = 2  # compilation happens in the first steps
    if args.backend == "fake":
        report = run_fake_rank(bench, args.world, args, threads=args.threads, timeout=3600)
    else:
        report = run_distributed(bench, 1, args, threads=args.threads, timeout=3600)[0]
    report["settings"] = vars(args)
    load = report["load"]
    print(f"host proxy: GPT-2 hidden {args.hidden}, {args.layers} layers, 1 x {args.tokens} tokens, {args.dtype}, "
          f"rank 0 of a {args.backend} world of {args.world}, compile {args.compile}, {args.threads} thread(s); "
          f"{args.rounds} rounds x {args.steps} steps; load average {load['min']:.1f}-{load['max']:.1f}")
    print(f"{'system':13} {'wall ms':>8} {'x plain':>8} {'range':>13} {'cpu ms':>8} {'cpu x plain':>12}")
    for name, row in report["systems"].items():
        print(f"{name:13} {row['wall_ms']:8.2f} {row['x_plain']:8.3f} "
              f"{row['x_plain_min']:6.3f}-{row['x_plain_max']:<6.3f} {row['cpu_ms']:8.2f} {row['cpu_x_plain']:12.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
