"""Per-rank peak memory and step time versus model size and versus steps: torch DDP, FSDP2,
DeepSpeed ZeRO 1-3 (when installed: `DS_BUILD_OPS=0 pip install deepspeed`; skipped otherwise) and
hfzero stages 0-3, each with its defaults, as a new user would run them (issue 14).

Every (system, size) pair runs in processes of its own (so one system's heap never inflates
another's peak): `world` gloo ranks, GPT-2 (vocab 8192, 128 positions), fp32 AdamW, 2 x 64 tokens
per rank. Per-rank peak = VmHWM (RSS high-water mark, reset with /proc/self/clear_refs once the
system is set up, so it includes the libraries and the states already resident) after each step;
CUDA ranks report peak reserved / allocated instead. The largest-model table fits peak = a + b Ψ per
system over the sizes run and solves world x peak = the host's memory (`--memory-gib`).
`--check-largest F` then builds hfzero stage 3 with `init_sharded` at F x its predicted limit and
runs one step (it uses nearly all of the host's memory: run it on a machine of your own).

    python benchmarks/scale.py [--sizes 35M 91M] [--world 4] [--steps 8] [--systems ...] [--json OUT]
    python benchmarks/scale.py --sizes 5M --world 2        # the small-model point
    python benchmarks/scale.py --sizes 200M --systems zero3 fsdp2 deepspeed3
    python benchmarks/scale.py --sizes 91M --systems ddp zero0 zero1 zero2 zero3 --rounds 2 --steps 5 --json M.json
    hfzero plan --config ./gpt2-91m --cpu-ranks 4 --dtype fp32 --optimizer adamw --seq-len 64 --global-batch 8 --measured M.json

``--rounds R`` runs the systems of each size in alternation R times (step time: the median of the rounds'
medians); the JSON's "workload" is what ``hfzero plan --measured`` checks before it names the fastest
measured configuration that fits.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from typing import Any

import torch

import hfzero
from hfzero.planning.estimate import model_states_bytes
from hfzero.testing import run_distributed
from hfzero.testing.procmem import status

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from zero_vs_ddp import _build, _step  # noqa: E402 - the peers' setup lives in one place

SIZES = {  # name -> (hidden, layers); vocab 8192, 128 positions
    "5M": (256, 4), "35M": (512, 10), "91M": (768, 12), "200M": (1024, 15),
}
SYSTEMS = ["ddp", "fsdp2", "deepspeed1", "deepspeed2", "deepspeed3", "zero0", "zero1", "zero2", "zero3"]
VOCAB, SEQ, BATCH = 8192, 64, 2
STAGE = {"ddp": 0, "fsdp2": 3, "deepspeed1": 1, "deepspeed2": 2, "deepspeed3": 3,
         "zero0": 0, "zero1": 1, "zero2": 2, "zero3": 3}


def _peak(device: torch.device) -> dict[str, int]:
    if device.type == "cuda":
        return {"reserved": torch.cuda.max_memory_reserved(device), "allocated": torch.cuda.max_memory_allocated(device)}
    return {"rss": status("VmHWM")}


def _reset_peak(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
        f.write("5")


def _run(rank: int, world: int, system: str, size: str, steps: int) -> dict[str, Any] | None:
    hidden, layers = SIZES[size]
    args = argparse.Namespace(hidden=hidden, layers=layers, vocab=VOCAB, seq=SEQ, batch=BATCH, bucket=None)
    built = _build(system, args)
    if built is None:
        return None
    model, optimizer, engine = built
    device = next(model.parameters()).device
    if system.startswith("zero"):
        num_params = hfzero.get_engine(model).num_params
    else:  # DeepSpeed stage 3 keeps the full size in ds_numel; FSDP2's DTensors report the global size
        num_params = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
    _reset_peak(device)
    g = torch.Generator().manual_seed(rank)
    peaks, times, cpu_times = [], [], []
    for _ in range(steps):
        batch = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g).to(device)  # (B, T)
        start, cpu = time.perf_counter(), time.process_time()
        _step(model, optimizer, engine, batch)
        times.append(time.perf_counter() - start)
        cpu_times.append(time.process_time() - cpu)
        peaks.append(_peak(device))
    return {"num_params": num_params, "peaks": peaks, "times": times, "cpu_times": cpu_times, "device": device.type}


def _measure(system: str, size: str, world: int, steps: int, clock: str = "wall") -> dict[str, Any] | None:
    """One run of ``system``: the worst rank's peak by step and the median step time after the first step, by
    ``clock``: "wall" (rank 0's wall seconds) or "cpu" (the busier rank's process CPU seconds: all its threads,
    waits excluded; what to compare on a machine shared with other work, where wall time is the others' too)."""
    per_rank = run_distributed(_run, world, system, size, steps, timeout=1800)
    if per_rank[0] is None:
        return None
    key = "rss" if per_rank[0]["device"] == "cpu" else "reserved"
    by_step = [max(r["peaks"][i][key] for r in per_rank) for i in range(steps)]  # worst rank
    wall = per_rank[0]["times"][1:] or per_rank[0]["times"]
    cpu = [max(r["cpu_times"][i] for r in per_rank) for i in range(steps)][1:] or per_rank[0]["cpu_times"]
    return {"system": system, "size": size, "num_params": per_rank[0]["num_params"], "metric": key,
            "peak_by_step": by_step, "median_wall_s": statistics.median(wall), "median_cpu_s": statistics.median(cpu),
            "median_step_s": statistics.median(cpu if clock == "cpu" else wall)}


def _formula_saving(num_params: int, world: int, stage: int) -> float:
    """Model-state bytes the paper's formula saves against DDP (fp32 AdamW: p = g = 4, K = 8)."""
    kw = {"param_bytes": 4, "grad_bytes": 4, "optimizer_k": 8}
    return model_states_bytes(num_params, world, 0, **kw) - model_states_bytes(num_params, world, stage, **kw)


def _largest(rows: list[dict], world: int, memory: float) -> dict[str, float]:
    """Per system: peak = a + b Psi through its two largest sizes run (the slope where the model states
    dominate: hfzero's transient buffers grow with Psi up to their cap, so a line through the smallest
    size overstates its slope); the Psi at which ``world`` ranks fill ``memory``."""
    out = {}
    for system in dict.fromkeys(r["system"] for r in rows):
        points = sorted((r["num_params"], r["peak_by_step"][-1]) for r in rows if r["system"] == system)
        if len(points) < 2:
            continue
        (x0, y0), (x1, y1) = points[-2], points[-1]
        b = (y1 - y0) / (x1 - x0)
        a = y0 - b * x0
        out[system] = {"bytes_per_param": b, "fixed_bytes": a, "largest_params": (memory / world - a) / b,
                       "fitted_sizes": [x0, x1]}
    return out


def _fits(rows: list[dict], system: str, size: str, world: int) -> tuple[bool, float]:
    """Whether ``system`` at ``size`` is predicted (from its sizes measured so far) to fit in the memory
    available now; (True, 0) when there is nothing to predict from."""
    points = sorted((r["num_params"], r["peak_by_step"][-1]) for r in rows if r["system"] == system)
    if len(points) < 2:
        return True, 0.0
    hidden, layers = SIZES[size]
    params = VOCAB * hidden + 128 * hidden + layers * 12 * hidden * hidden
    (x0, y0), (x1, y1) = points[-2], points[-1]
    need = world * (y1 + (y1 - y0) / (x1 - x0) * (params - x1))
    return need < 0.9 * status("MemAvailable", "/proc/meminfo"), need


def _check(rank: int, world: int, num_params: float) -> dict[str, Any]:
    """hfzero stage 3 built with init_sharded (no rank materializes the model), one step."""
    from transformers import GPT2Config

    from hfzero.loading.construct import init_sharded

    hidden = 2048
    layers = max(1, round((num_params - VOCAB * hidden) / (12 * hidden * hidden)))
    config = GPT2Config(vocab_size=VOCAB, n_positions=128, n_embd=hidden, n_layer=layers, n_head=16,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)
    model, opt = init_sharded(config, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-4),
                              hfzero.ZeroConfig(stage=3))
    _reset_peak(torch.device("cpu"))
    start = time.perf_counter()
    batch = torch.randint(0, VOCAB, (BATCH, SEQ))
    model(input_ids=batch, labels=batch).loss.backward()
    opt.step()
    return {"num_params": hfzero.get_engine(model).num_params, "peak_rss": status("VmHWM"),
            "step_s": time.perf_counter() - start}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", default=["35M", "91M"], choices=list(SIZES))
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                        help="step time as wall seconds (default) or the busier rank's CPU seconds (a shared machine)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run every system this many times per size, in alternation; step time = median of rounds")
    parser.add_argument("--systems", nargs="+", default=SYSTEMS, choices=SYSTEMS)
    parser.add_argument("--memory-gib", type=float, default=24.0, help="host memory for the largest-model table")
    parser.add_argument("--check-largest", type=float, default=0.0,
                        help="run hfzero stage 3 at this fraction of its predicted largest model (0: skip)")
    parser.add_argument("--check-params", type=float, default=0.0,
                        help="run hfzero stage 3 (init_sharded) at this many parameters instead (0: skip)")
    parser.add_argument("--json", help="also write the figures to this JSON file")
    parser.add_argument("--reuse", nargs="*", default=[],
                        help="JSON files of earlier runs (same world and steps): their rows are reused, not re-run")
    args = parser.parse_args()
    rows = []
    for path in args.reuse:
        with open(path, encoding="utf-8") as f:
            earlier = json.load(f)
        if (earlier["args"]["world"], earlier["args"]["steps"]) != (args.world, args.steps):
            raise SystemExit(f"{path}: measured with world {earlier['args']['world']}, steps "
                             f"{earlier['args']['steps']}; this run uses {args.world}, {args.steps}")
        rows += [r for r in earlier["rows"] if not any((q["system"], q["size"]) == (r["system"], r["size"]) for q in rows)]
    args.sizes = list(dict.fromkeys([r["size"] for r in rows] + args.sizes))
    args.sizes.sort(key=lambda size: SIZES[size][0] ** 2 * SIZES[size][1])
    for size in args.sizes:
        todo = [s for s in args.systems if not any((r["system"], r["size"]) == (s, size) for r in rows)]
        runs: dict[str, list[dict]] = {}
        for round_ in range(args.rounds):  # systems in alternation: a drift of the machine's speed hits all alike
            for system in todo:
                if round_ == 0:
                    fits, need = _fits(rows, system, size, args.world)
                    if not fits:
                        print(f"{size} {system}: skipped, predicted {need / 2**30:.1f} GiB for {args.world} ranks is "
                              f"more than 90% of the memory available now", flush=True)
                        continue
                elif system not in runs:
                    continue
                row = _measure(system, size, args.world, args.steps, args.clock)
                if row is None:
                    print(f"{system}: not installed, skipped", flush=True)
                    continue
                runs.setdefault(system, []).append(row)
                print(f"{size} {system} round {round_ + 1}: peak MB by step "
                      f"{[round(p / 1e6) for p in row['peak_by_step']]}, median step {row['median_step_s']:.3f}s",
                      flush=True)
        for system, measured in runs.items():
            rows.append(_combine(measured))
    _report(rows, args)


def _combine(rounds: list[dict]) -> dict:
    """One row from a system's rounds: the worst peak at each step, the median of the rounds' step times."""
    row = dict(rounds[0])
    row["peak_by_step"] = [max(r["peak_by_step"][i] for r in rounds) for i in range(len(row["peak_by_step"]))]
    row["step_s_by_round"] = [r["median_step_s"] for r in rounds]
    row["median_step_s"] = statistics.median(row["step_s_by_round"])
    return row


def _report(rows: list[dict], args: argparse.Namespace) -> None:
    print(f"\nworld {args.world}, gloo, GPT-2 vocab {VOCAB}, {BATCH} x {SEQ} tokens per rank, fp32 AdamW, "
          f"defaults of each system; per-rank peak (worst rank) in MB")
    marks = sorted({1, min(3, args.steps), args.steps})
    print(f"{'size':>5} {'system':<11} " + " ".join(f"{'@' + str(m):>7}" for m in marks)
          + f" {'step s':>7} {'saved vs DDP':>13} {'formula':>8} {'share':>6}")
    for size in args.sizes:
        ddp = next((r for r in rows if r["size"] == size and r["system"] == "ddp"), None)
        for r in (r for r in rows if r["size"] == size):
            line = f"{size:>5} {r['system']:<11} " + " ".join(f"{r['peak_by_step'][m - 1] / 1e6:>7.0f}" for m in marks)
            line += f" {r['median_step_s']:>7.3f}"
            stage = STAGE[r["system"]]
            if ddp is not None and stage > 0:
                saved = ddp["peak_by_step"][-1] - r["peak_by_step"][-1]
                formula = _formula_saving(r["num_params"], args.world, stage)
                r.update(saved_vs_ddp=saved, formula_saving=formula)
                line += f" {saved / 1e6:>13.0f} {formula / 1e6:>8.0f} {saved / formula:>6.2f}"
            print(line)
    memory = args.memory_gib * 2**30
    largest = _largest(rows, args.world, memory)
    if largest:
        print(f"\nlargest model on {args.memory_gib:g} GiB with {args.world} ranks (peak = a + b Psi through each "
              f"system's two largest sizes; activations as above)")
        ddp = largest.get("ddp", {}).get("largest_params")
        for system, fit in largest.items():
            ratio = f"{fit['largest_params'] / ddp:5.2f}x DDP" if ddp else ""
            sizes = "-".join(f"{x / 1e6:.0f}M" for x in fit["fitted_sizes"])
            print(f"  {system:<11} {fit['bytes_per_param']:6.2f} B/param + {fit['fixed_bytes'] / 1e6:6.0f} MB "
                  f"-> {fit['largest_params'] / 1e6:8.0f}M parameters {ratio} (fit {sizes})")
    check = None
    if args.check_params or (args.check_largest and "zero3" in largest):
        target = args.check_params or args.check_largest * largest["zero3"]["largest_params"]
        check = run_distributed(_check, args.world, target, timeout=3600)
        worst = max(c["peak_rss"] for c in check)
        print(f"\ncheck: hfzero stage 3 (init_sharded) at {check[0]['num_params'] / 1e6:.0f}M parameters: "
              f"peak {worst / 1e6:.0f} MB per rank ({args.world} ranks: {args.world * worst / 2**30:.1f} GiB), "
              f"step {check[0]['step_s']:.1f}s")
    if args.json:
        with open(args.json, "w") as f:
            workload = {"world": args.world, "batch_per_rank": BATCH, "seq_len": SEQ, "dtype": "fp32",
                        "optimizer": "adamw", "rounds": args.rounds, "clock": args.clock}  # what `hfzero plan --measured` matches
            json.dump({"args": vars(args), "workload": workload, "rows": rows, "largest": largest, "check": check},
                      f, indent=2)


if __name__ == "__main__":
    main()
