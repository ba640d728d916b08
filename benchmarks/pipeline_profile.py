"""Per-stage profile of pipeline x ZeRO: for ZeRO stages 0-3 (default policy) at pp=2 x dp=2 on 4 gloo
ranks, ZeroProfiler records each run (the custom-loop API) and ``hfzero.profiler.stages.stage_table``
gives, per pipeline stage, model states by role beside the cost model, the measured bubble (idle / busy
in the schedule, median over steps and ranks) beside (P - 1)/M, the dp collectives' elements per step and
the P2P bytes per step beside the cost model.

One spawn runs every case; prints a Markdown table (the one in docs/pipeline.md). Usage:

    python benchmarks/pipeline_profile.py [--hidden 64] [--layers 4] [--micro 4] [--steps 6] [--schedule 1F1B]
        [--stages 0,1,2,3] [--out DIR] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from hfzero.profiler.reader import load_run, summarize
from hfzero.testing import run_distributed
from hfzero.testing.pipeline import PipeSpec, train_pipelines

CASES = [(0, "local", "step"), (1, "local", "step"), (2, "sharded", "step"), (3, "sharded", "step")]
"""(ZeRO stage, accumulation, stage-3 gathering): the defaults ("auto": sharded at stages 2-3)."""


def _cases(args: argparse.Namespace) -> list[tuple[int, str, str]]:
    wanted = {int(x) for x in args.stages.split(",")}
    return [case for case in CASES if case[0] in wanted]


def _specs(args: argparse.Namespace) -> list[PipeSpec]:
    return [PipeSpec(model="llama", layers=args.layers, hidden=args.hidden, pp=2, stage=stage, accumulation=policy,
                     stage3_gather=gather, schedule=args.schedule, n_micro=args.micro, dtype="bf16", steps=args.steps,
                     global_batch=32, seq_len=args.seq, bucket_size=args.bucket, profile=True,
                     extra_config=(("param_persistence_threshold", 0),) if stage == 3 else ())
            for stage, policy, gather in _cases(args)]


def _rows(stage: int, run_dir: Path) -> list[dict]:
    run = load_run(run_dir)
    rows = []
    for row in summarize(run)["pipeline"]:
        roles = {k: v for k, v in row["roles_peak"].items() if k in (row["predicted_roles"] or {})}
        states = sum(roles.values())
        rows.append({"zero_stage": stage, "pp_rank": row["pp_rank"], "model_states": states,
                     "predicted": row["predicted_model_state_bytes"], "roles": roles,
                     "bubble": row["bubble_fraction"], "idle_fraction": row["idle_fraction"],
                     "bubble_estimate": row["bubble_estimate"], "busy": row["busy_seconds"],
                     "idle": row["idle_seconds"],
                     "dp_elements": sum(row["comm_elements_per_step"].values()),
                     "dp_predicted": sum((row["predicted_comm_elements_per_step"] or {}).values()),
                     "p2p": row["p2p_bytes_per_step"], "p2p_estimate": row["p2p_estimate"]})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--micro", type=int, default=4)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--bucket", type=int, default=1 << 16)
    parser.add_argument("--schedule", default="1F1B")
    parser.add_argument("--out", help="keep the profiles here (default: a temporary directory)")
    parser.add_argument("--json", help="also write the rows as JSON here")
    parser.add_argument("--stages", default="0,1,2,3", help="ZeRO stages to run, e.g. 0,1,2 (ZBVZeroBubble and "
                        "DualPipeV refuse stage 3 with tied embeddings)")
    args = parser.parse_args()
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="hfzero-pp-profile-"))
    run_distributed(train_pipelines, 4, _specs(args), str(out), timeout=1800)
    rows = [r for i, (stage, _, _) in enumerate(_cases(args)) for r in _rows(stage, out / str(i))]
    print(f"pp=2 x dp=2, Llama (tied) hidden {args.hidden}, {args.layers} blocks, seq {args.seq}, global batch 32, "
          f"bf16 + AdamW, {args.schedule}, {args.micro} micro-batches; medians over {args.steps} steps and the "
          f"stage's 2 ranks; profiles in {out}")
    print("| ZeRO | pp rank | model states (B) | cost model (B) | roles | bubble idle/busy | (P-1)/M | idle/wall "
          "| dp elements/step | cost model | P2P sent / recv (B/step) | cost model |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        roles = ", ".join(f"{k} {v}" for k, v in r["roles"].items())
        print(f"| {r['zero_stage']} | {r['pp_rank']} | {r['model_states']} | {r['predicted']} | {roles} | "
              f"{r['bubble']:.3f} | {r['bubble_estimate']:.3f} | {r['idle_fraction']:.3f} | {r['dp_elements']:.0f} | "
              f"{r['dp_predicted']} | {r['p2p']['send']:.0f} / {r['p2p']['recv']:.0f} | {r['p2p_estimate']['send']} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
