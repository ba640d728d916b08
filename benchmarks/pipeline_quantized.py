"""The seed's M-fold cost between nodes, with and without quantized gradients (issue 22, item 5).

    python benchmarks/pipeline_quantized.py [--hidden 64] [--layers 4] [--micro 2 8] [--dtype fp32] [--json]

pp 2 x dp 4 on 8 gloo ranks, simulated nodes of ``--ranks-per-node`` (default 2: each stage's dp group spans 2
nodes), a tiny tied Llama, ZeRO stage 2 under 1F1B. For each M in ``--micro``: "local" accumulation (one reduction
per step), "sharded" (M per-micro-batch reduce-scatters: ZeRO-2 memory, the M-fold traffic), and "sharded" with
qgZ int8 and int4 (``--block`` elements per scale). Per system: the inter-node bytes per step of dp rank 0 of each
stage (measured: hfzero/comm/collectives.py's node split), the pipeline cost model's (``estimate_pipeline(...)
["ranks"][pp]["inter_node_bytes_per_step"]``), their ratio to "local", and the last step's loss beside the
unquantized "sharded" run's.
"""

from __future__ import annotations

import argparse
import json

from hfzero.parallel.pipeline.cost import estimate_pipeline, stage_shapes
from hfzero.testing import run_distributed
from hfzero.testing.models import tiny_causal_lm
from hfzero.testing.pipeline import PipeSpec, train_pipelines

SYSTEMS = {  # name -> (accumulation, quantize_gradients)
    "local": ("local", None),
    "sharded": ("sharded", None),
    "sharded + qgZ int8": ("sharded", "int8"),
    "sharded + qgZ int4": ("sharded", "int4"),
}


def _specs(args: argparse.Namespace) -> dict[tuple[int, str], PipeSpec]:
    specs = {}
    for micro in args.micro:
        for name, (policy, qg) in SYSTEMS.items():
            extra = (("ranks_per_node", args.ranks_per_node),)
            if qg:
                extra += (("quantize_gradients", qg), ("quantize_block", args.block))
            specs[micro, name] = PipeSpec(model="llama", layers=args.layers, hidden=args.hidden, pp=2, stage=2,
                                          accumulation=policy, n_micro=micro, dtype=args.dtype, steps=args.steps,
                                          global_batch=8 * micro, seq_len=32, bucket_size=args.bucket,
                                          extra_config=extra)
    return specs


def _run(rank: int, world: int, specs: list[PipeSpec]) -> list[dict]:
    return [{"coords": r["coords"], "inter": r["inter_node_bytes_per_step"], "losses": r["losses"]}
            for r in train_pipelines(rank, world, specs)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--micro", type=int, nargs="+", default=[2, 8])
    parser.add_argument("--ranks-per-node", type=int, default=2)
    parser.add_argument("--block", type=int, default=256)
    parser.add_argument("--bucket", type=int, default=1 << 16)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    specs = _specs(args)
    per_rank = run_distributed(_run, 8, list(specs.values()), timeout=1800)
    shapes = stage_shapes(tiny_causal_lm("llama", layers=args.layers, hidden=args.hidden), 2)
    rows = []
    for i, ((micro, name), spec) in enumerate(specs.items()):
        policy, qg = SYSTEMS[name]
        model = estimate_pipeline(shapes, pp=2, dp=4, stage=2, n_micro=micro, accumulation=policy, dtype=args.dtype,
                                  ranks_per_node=args.ranks_per_node, quantize_gradients=qg, quantize_block=args.block)
        for ranks in per_rank:
            out = ranks[i]
            if out["coords"][1] == 0:
                rows.append({"micro": micro, "system": name, "pp_rank": out["coords"][0],
                             "inter_node_bytes_per_step": sum(out["inter"]) / len(out["inter"]),
                             "model": model["ranks"][out["coords"][0]]["inter_node_bytes_per_step"],
                             "last_loss": out["losses"][-1]})
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    print(f"pp 2 x dp 4, nodes of {args.ranks_per_node}, {args.dtype} Llama hidden {args.hidden} x {args.layers}, stage 2, "
          f"1F1B, block {args.block}; dp rank 0 of each stage, per step")
    print(f"{'M':>3} {'system':<20} {'pp':>3} {'inter-node B':>14} {'cost model':>14} {'vs local':>9} {'last loss':>10}")
    for row in rows:
        local = next(r for r in rows if (r["micro"], r["system"], r["pp_rank"]) == (row["micro"], "local", row["pp_rank"]))
        print(f"{row['micro']:>3} {row['system']:<20} {row['pp_rank']:>3} {row['inter_node_bytes_per_step']:>14,.0f} "
              f"{row['model']:>14,.0f} {row['inter_node_bytes_per_step'] / local['inter_node_bytes_per_step']:>9.2f} "
              f"{row['last_loss']:>10.5f}")


if __name__ == "__main__":
    main()
