"""Pipeline x ZeRO matrix: per-rank model-state bytes by role, activation peak, communication elements
per step and step time for ZeRO stages 0-3 x accumulation policy (x stage-3 gathering) x n_micro in
{2, 4, 8} at pp=2 x dp=2 on 4 gloo ranks, beside the cost model (hfzero/parallel/pipeline/cost.py).

One spawn runs every case (each builds its own mesh); prints the Markdown table of docs/pipeline.md.
``--prefetch`` instead measures stage 3's prefetch across micro-batches (PipelineConfig.stage3_cross_prefetch)
on vs off, side by side in one spawn (the two alternate, ``--repeats`` times each): units gathered early per
step, all-gather elements per step and the median step time. Usage:

    python benchmarks/pipeline_zero.py [--hidden 64] [--layers 4] [--steps 4] [--json OUT]
    python benchmarks/pipeline_zero.py --prefetch [--layers 8] [--steps 6] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics

from hfzero.parallel.pipeline.cost import comm_elements, model_state_roles, stage_shapes
from hfzero.testing import run_distributed
from hfzero.testing.models import tiny_causal_lm
from hfzero.testing.pipeline import PipeSpec, train_pipelines

POLICIES = [(0, "local", "step"), (0, "sharded", "step"), (1, "local", "step"), (1, "sharded", "step"),
            (2, "local", "step"), (2, "sharded", "step"), (3, "local", "step"), (3, "sharded", "step"),
            (3, "local", "micro"), (3, "sharded", "micro")]
STATE_ROLES = ("param_full", "param_shard", "param_gathered", "grad_full", "grad_shard", "grad_accum",
               "master_shard", "optim_state")


def _specs(args: argparse.Namespace) -> list[PipeSpec]:
    return [PipeSpec(model="llama", layers=args.layers, hidden=args.hidden, pp=2, stage=stage, accumulation=policy,
                     stage3_gather=gather, schedule="1F1B", n_micro=micro, dtype="bf16", steps=args.steps,
                     global_batch=32, seq_len=args.seq, max_grad_norm=1.0, bucket_size=args.bucket,
                     extra_config=(("param_persistence_threshold", 0),) if stage == 3 else (),
                     measure_activations=True)
            for stage, policy, gather in POLICIES for micro in (2, 4, 8)]


def _row(spec: PipeSpec, outs: list[dict], shapes) -> dict:
    rank0 = next(o for o in outs if o["coords"] == (0, 0))  # first stage, dp rank 0
    roles = dict(rank0["step_roles"])
    states = sum(roles.get(r, 0) for r in STATE_ROLES)
    comm = sum(rank0["comm_per_step"][-1].get(k, 0) for k in ("all_reduce", "reduce_scatter", "all_gather"))
    expected_roles = model_state_roles(shapes[0].params, 2, spec.stage, dtype=spec.dtype,
                                       accumulation=spec.accumulation, stage3_gather=spec.stage3_gather)
    expected_comm = comm_elements(shapes[0].params, 2, spec.stage, spec.n_micro, accumulation=spec.accumulation,
                                  stage3_gather=spec.stage3_gather, tied=shapes[0].tied)
    times = [max(o["step_seconds"][i] for o in outs) for i in range(1, spec.steps)]  # skip the first step
    return {
        "stage": spec.stage, "policy": spec.accumulation, "gather": spec.stage3_gather if spec.stage == 3 else "",
        "n_micro": spec.n_micro, "model_states_bytes": states, "estimate_model_states_bytes": sum(expected_roles.values()),
        "roles": {r: roles.get(r, 0) for r in STATE_ROLES if roles.get(r, 0)},
        "activation_peak_bytes": max(o["activation_peak_bytes"] for o in outs if o["coords"][0] == 0),
        "comm_elements": comm, "estimate_comm_elements": sum(expected_comm.values()),
        "step_seconds": statistics.median(times),
        "losses_match": max(abs(a - b) for a, b in zip(rank0["losses"], outs[-1]["losses"])),
    }


def _prefetch_specs(args: argparse.Namespace) -> list[PipeSpec]:
    return [PipeSpec(model="llama", layers=args.layers, hidden=args.hidden, pp=2, stage=3, accumulation="sharded",
                     stage3_gather="micro", cross_prefetch=cross, schedule=schedule, n_micro=micro, dtype="bf16",
                     steps=args.steps, global_batch=32, seq_len=args.seq, max_grad_norm=1.0, bucket_size=args.bucket,
                     extra_config=(("param_persistence_threshold", 0),))
            for schedule in ("1F1B", "GPipe") for micro in (4, 8) for _ in range(args.repeats)
            for cross in (True, False)]


def _prefetch_table(specs: list[PipeSpec], per_rank: list[list[dict]]) -> list[dict]:
    rows: dict[tuple, dict] = {}
    for i, spec in enumerate(specs):
        outs = [r[i] for r in per_rank]
        row = rows.setdefault((spec.schedule, spec.n_micro, spec.cross_prefetch), {
            "schedule": spec.schedule, "n_micro": spec.n_micro, "cross_prefetch": spec.cross_prefetch,
            "early_gathers_per_step": max(o["cross_prefetches"] for o in outs) / (spec.steps - 1),
            "all_gather_elements": outs[0]["comm_per_step"][-1].get("all_gather", 0), "step_seconds": []})
        row["step_seconds"] += [max(o["step_seconds"][k] for o in outs) for k in range(1, spec.steps)]
    for row in rows.values():
        row["step_seconds"] = statistics.median(row["step_seconds"])
    return list(rows.values())


def _prefetch_main(args: argparse.Namespace) -> None:
    specs = _prefetch_specs(args)
    per_rank = run_distributed(train_pipelines, 4, specs, timeout=3000, threads=1)
    rows = _prefetch_table(specs, per_rank)
    print(f"pp=2 x dp=2, Llama (tied) hidden {args.hidden}, {args.layers} blocks, seq {args.seq}, global batch 32, "
          f"bf16 + AdamW, ZeRO-3 sharded, per-micro-batch gathering; {args.repeats} alternating runs x "
          f"{args.steps - 1} steps per cell (first step of each run skipped; step = slowest rank)")
    print("| schedule | n_micro | cross prefetch | units gathered early / step | all-gather elements / step (rank 0) "
          "| step (ms, median) | off / on |")
    print("|---|---|---|---|---|---|---|")
    by_key = {(r["schedule"], r["n_micro"], r["cross_prefetch"]): r for r in rows}
    for r in rows:
        on = by_key[(r["schedule"], r["n_micro"], True)]["step_seconds"]
        ratio = f"{r['step_seconds'] / on:.2f}" if not r["cross_prefetch"] else ""
        print(f"| {r['schedule']} | {r['n_micro']} | {'on' if r['cross_prefetch'] else 'off'} | "
              f"{r['early_gathers_per_step']:.0f} | {r['all_gather_elements']} | {1000 * r['step_seconds']:.1f} | {ratio} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--bucket", type=int, default=1 << 20)
    parser.add_argument("--json", metavar="OUT")
    parser.add_argument("--prefetch", action="store_true", help="stage-3 prefetch across micro-batches on vs off")
    parser.add_argument("--repeats", type=int, default=3, help="--prefetch: alternating runs per cell")
    args = parser.parse_args()
    if args.prefetch:
        _prefetch_main(args)
        return
    specs = _specs(args)
    per_rank = run_distributed(train_pipelines, 4, specs, timeout=3000, threads=1)
    shapes = stage_shapes(tiny_causal_lm("llama", layers=args.layers, hidden=args.hidden), 2)
    rows = [_row(spec, [r[i] for r in per_rank], shapes) for i, spec in enumerate(specs)]
    print(f"pp=2 x dp=2, Llama (tied) hidden {args.hidden}, {args.layers} blocks, seq {args.seq}, global batch 32, "
          f"bf16 + AdamW, 1F1B; first stage (pp rank 0, dp rank 0): {shapes[0].params} parameters")
    print("| stage | policy | gather | n_micro | model states (B) | estimate (B) | roles | activation peak (B) "
          "| comm elements/step | estimate | step (ms) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        roles = ", ".join(f"{k} {v}" for k, v in r["roles"].items())
        print(f"| {r['stage']} | {r['policy']} | {r['gather']} | {r['n_micro']} | {r['model_states_bytes']} | "
              f"{r['estimate_model_states_bytes']:.0f} | {roles} | {r['activation_peak_bytes']} | "
              f"{r['comm_elements']} | {r['estimate_comm_elements']:.0f} | {1000 * r['step_seconds']:.1f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
