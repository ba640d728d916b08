"""``hfzero estimate --pp P``: per-rank model states by role, communication per step, activations in
flight and the bubble for pipeline x ZeRO (see hfzero/parallel/pipeline/cost.py and docs/pipeline.md)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from hfzero.planning import estimate as est
from hfzero.config import ConfigError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("pipeline x ZeRO (with --pp)")
    group.add_argument("--pp", metavar="P", type=int, help="pipeline stages: per-rank figures for each stage")
    group.add_argument("--micro", metavar="M", type=int, default=4, help="micro-batches per step (default 4)")
    group.add_argument("--stage", metavar="S", type=int, choices=(0, 1, 2, 3),
                       help="ZeRO stage (default: all four)")
    group.add_argument("--schedule", default="1F1B", help="GPipe | 1F1B | Interleaved1F1B | ... (default 1F1B)")
    # --accumulation (auto | sharded | local) is the main parser's; with --pp it applies to each stage
    group.add_argument("--gather", default="step", choices=("step", "micro"),
                       help="stage 3: gather once per step (default) or per micro-batch")


def run(args: argparse.Namespace) -> int:
    from hfzero.parallel.pipeline.cost import StageShape, estimate_pipeline, stage_shapes
    from hfzero.parallel.pipeline.schedule import resolve_schedule

    try:
        if args.pp < 1 or args.micro < 1 or int(args.dp) < 1:
            raise est.EstimateError("--pp, --micro and --dp must be positive integers")
        est.resolve_accumulation(0, args.accumulation)  # validates the policy name
        kind = resolve_schedule(args.schedule)
        nodes, shard = _int_option("--nodes", args.nodes), _int_option("--shard-size", args.shard_size)
        world = args.pp * int(args.dp)
        if nodes < 1 or world % nodes:
            raise est.EstimateError(f"--nodes {nodes} must be a positive integer dividing the world --pp x --dp "
                                    f"= {world} (ranks are placed on nodes in blocks: rank = pp_rank x dp + dp_rank)")
        if shard < 0 or (shard and int(args.dp) % shard):
            raise est.EstimateError(f"--shard-size {shard} must divide --dp {args.dp} (HSDP inside each stage)")
        block = _int_option("--quantize-block", args.quantize_block)
        if block < 1 or (args.quantize_gradients == "int4" and block % 2):
            raise est.EstimateError(f"--quantize-block {block} must be a positive integer (even with int4)")
        if args.config:
            model = est._meta_model(est.load_hf_config(args.config))
            shapes = stage_shapes(model, args.pp, stages_per_rank=kind.stages_per_rank)
        elif args.params:
            stages = args.pp * kind.stages_per_rank
            shapes = [StageShape(int(float(args.params)) // stages, 0, 0)] * stages
        else:
            raise est.EstimateError("give the model with --config PATH (split like hfzero.pipeline) or --params N "
                                    "(split evenly)")
        results = [estimate_pipeline(shapes, pp=args.pp, dp=int(args.dp), stage=stage, n_micro=args.micro,
                                     schedule=kind.name, dtype=args.dtype, optimizer=args.optimizer,
                                     accumulation=args.accumulation, stage3_gather=args.gather,
                                     stages_per_rank=kind.stages_per_rank, shard_size=shard if stage else 0,
                                     ranks_per_node=world // nodes, quantize_weights=args.quantize_weights,
                                     quantize_gradients=args.quantize_gradients, quantize_block=block,
                                     quantize_error_feedback=args.quantize_error_feedback)
                   for stage in ([args.stage] if args.stage is not None else est.STAGES)]
    except (est.EstimateError, ConfigError, ValueError) as exc:
        print(f"hfzero estimate: error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(results, indent=2) if args.json else _render(results))
    return 0


def _int_option(flag: str, value: Any) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        raise est.EstimateError(f"{flag} must be an integer, got {value!r}") from None


def _render(results: list[dict[str, Any]]) -> str:
    first = results[0]
    nodes = first["pp"] * first["dp"] // first["ranks_per_node"]
    quantized = first.get("quantize_weights") or first.get("quantize_gradients")
    lines = [f"pp {first['pp']} x dp {first['dp']}, {first['n_micro']} micro-batches, {first['schedule']}, "
             f"{first['dtype']} + {first['optimizer']}; bubble fraction {first['bubble_fraction']:.3f}"
             + (f"; {nodes} nodes of {first['ranks_per_node']} ranks" if nodes > 1 else "")
             + (f"; quantized (weights {first['quantize_weights'] or 'no'}, gradients "
                f"{first['quantize_gradients'] or 'no'}, block {first['quantize_block']}; stage 0 unquantized)"
                if quantized else "")]
    for result in results:
        lines.append(f"stage {result['stage']} ({result['accumulation']}"
                     + (f", gather per {result['stage3_gather']}" if result["stage"] == 3 else "")
                     + (f", HSDP over {result['shard_size']} ranks" if result["shard_size"] < result["dp"] else "")
                     + ")")
        lines.append(f"  {'pp rank':<8}{'params':>14}{'model states GB':>17}{'comm elements/step':>20}"
                     + (f"{'inter-node':>14}" if nodes > 1 else "")
                     + (f"{'bytes/step':>16}{'inter-node B':>16}" if quantized else "") + f"{'mb in flight':>14}")
        for rank in result["ranks"]:
            comm = sum(rank["comm_elements_per_step"].values())
            inter = f"{rank['inter_node_elements_per_step']:>14,.0f}" if nodes > 1 else ""
            if quantized:
                inter += f"{rank['comm_bytes_per_step']:>16,.0f}{rank['inter_node_bytes_per_step']:>16,.0f}"
            lines.append(f"  {rank['pp_rank']:<8}{rank['params']:>14,.0f}{rank['model_states_bytes'] / 1e9:>17.4f}"
                         f"{comm:>20,.0f}{inter}{rank['microbatches_in_flight']:>14}")
    return "\n".join(lines)
