"""``hfzero plan``: every feasible configuration of a model on some hardware, ranked by estimated
throughput, with the reason each rejected one does not fit; ``--verify`` runs the top choice here.
See ``docs/plan.md`` and [Note: plan cost model] in ``hfzero/planning/plan.py``."""

from __future__ import annotations

import argparse
import json
import re
import sys
from typing import Any

from hfzero.planning import estimate as est
from hfzero.planning import plan as planner
from hfzero.planning.measured import fastest_that_fits, read_measurements

_GB = 1e9


def register(subparsers: Any) -> None:
    """Add the ``plan`` subcommand."""
    parser = subparsers.add_parser(
        "plan", help="rank every ZeRO / pp / tp / offload / checkpointing configuration that fits the hardware",
        description="Every configuration (ZeRO stage 0-3, accumulation policy, offload, checkpointing + P_a, pp, tp, "
        "micro-batch) with its per-rank peak memory (model states + transient + activations) and an estimated step "
        "time; ranked by estimated throughput among those that fit, with the reason each other one does not.")
    model = parser.add_argument_group("model (one of --config, --params)")
    model.add_argument("--config", metavar="PATH", help="a Hugging Face config.json or a local model directory")
    model.add_argument("--params", metavar="N", help="trainable parameters, e.g. 7.5e9 (no activations without --config)")
    model.add_argument("--dtype", default="bf16", help="fp32 | bf16 | fp16 (default bf16)")
    model.add_argument("--optimizer", default="adam", help="adam | adamw | sgd_momentum | sgd (default adam)")
    model.add_argument("--seq-len", metavar="S", type=int, default=1024, help="tokens per sequence (default 1024)")
    model.add_argument("--global-batch", metavar="B", type=int, help="sequences per optimizer step (default: 1 per device)")
    hw = parser.add_argument_group("hardware (one of --gpus, --cpu-ranks)")
    hw.add_argument("--gpus", metavar="NxMEM", help="GPUs per node and memory each, e.g. 8x80GB or 64x32GB")
    hw.add_argument("--cpu-ranks", metavar="N", type=int, help="N gloo ranks on this host's CPUs")
    hw.add_argument("--memory", metavar="SIZE", help="with --cpu-ranks: host memory shared by the ranks, e.g. 24GiB "
                    "(default: what is available now)")
    hw.add_argument("--nodes", metavar="N", type=int, default=1, help="nodes (default 1)")
    hw.add_argument("--intra", metavar="LINK", help="link inside a node: nvlink | pcie | shm | bytes/s "
                    "(default nvlink for GPUs, shm for CPU ranks)")
    hw.add_argument("--inter", metavar="LINK", default="ib", help="link between nodes: ib | ethernet | bytes/s (default ib)")
    hw.add_argument("--tflops", metavar="T", type=float,
                    help=f"sustained TFLOP/s per device (default {planner.DEFAULT_GPU_TFLOPS:g} per GPU, "
                         f"{planner.DEFAULT_CPU_GFLOPS / 1e3:g} per CPU rank)")
    hw.add_argument("--runtime-bytes", metavar="BYTES", type=float,
                    help="memory each process keeps for the framework (default 0 on GPUs; on CPU ranks measured once)")
    search = parser.add_argument_group("search")
    search.add_argument("--headroom", metavar="FRACTION", type=float, default=est.DEFAULT_HEADROOM,
                        help=f"fraction of memory kept free (default {est.DEFAULT_HEADROOM})")
    search.add_argument("--max-pp", metavar="P", type=int, default=8, help="largest pipeline degree (default 8)")
    search.add_argument("--max-tp", metavar="T", type=int,
                        help="largest tensor-parallel degree (default: a node's GPUs; 1 on CPU ranks)")
    search.add_argument("--top", metavar="K", type=int, default=10, help="configurations printed (default 10)")
    parser.add_argument("--verify", action="store_true",
                        help="with --cpu-ranks and --config: run the top choice for a few steps here and print the "
                             "measured peak beside the predicted one")
    parser.add_argument("--verify-steps", metavar="N", type=int, default=3, help="steps --verify runs (default 3)")
    parser.add_argument("--measured", metavar="FILE",
                        help="a `benchmarks/scale.py --json FILE` result for this workload: print its measured step "
                             "times beside the plan and name the fastest measured configuration that fits")
    parser.add_argument("--json", action="store_true", help="print a JSON object instead of a table")
    parser.set_defaults(func=run)


def _size(raw: str) -> float:
    match = re.fullmatch(r"\s*([0-9.eE+]+)\s*(GiB|GB|MiB|MB|TB|TiB)?\s*", raw)
    if not match:
        raise est.EstimateError(f"cannot read {raw!r} as a size, e.g. 80GB or 24GiB")
    units = {None: 1, "MB": 1e6, "GB": 1e9, "TB": 1e12, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}
    return float(match.group(1)) * units[match.group(2)]


def read_inputs(args: argparse.Namespace) -> tuple[planner.Workload, planner.Hardware]:
    """The workload and hardware from the command line (EstimateError on bad input)."""
    if (args.config is None) == (args.params is None):
        raise est.EstimateError("give the model with exactly one of --config PATH or --params N")
    if (args.gpus is None) == (args.cpu_ranks is None):
        raise est.EstimateError("give the hardware with exactly one of --gpus NxMEM or --cpu-ranks N")
    if args.nodes < 1 or args.seq_len < 1:
        raise est.EstimateError("--nodes and --seq-len must be positive")
    cpu = args.cpu_ranks is not None
    if cpu:
        per_node = args.cpu_ranks
        if per_node < 1:
            raise est.EstimateError("--cpu-ranks must be positive")
        total = _size(args.memory) if args.memory else _available_bytes()
        memory = total / per_node
        flops = (args.tflops * 1e12) if args.tflops else planner.DEFAULT_CPU_GFLOPS * 1e9
        runtime = args.runtime_bytes if args.runtime_bytes is not None else planner.runtime_bytes()
    else:
        match = re.fullmatch(r"(\d+)x(.+)", args.gpus)
        if not match:
            raise est.EstimateError(f"--gpus must read like 8x80GB, got {args.gpus!r}")
        per_node, memory = int(match.group(1)), _size(match.group(2))
        flops = (args.tflops or planner.DEFAULT_GPU_TFLOPS) * 1e12
        runtime = args.runtime_bytes or 0.0
    hardware = planner.Hardware(
        devices_per_node=per_node, nodes=args.nodes, memory_bytes=memory, flops=flops,
        intra_bytes_per_s=planner.link_bytes(args.intra or ("shm" if cpu else "nvlink")),
        inter_bytes_per_s=planner.link_bytes(args.inter), cpu=cpu, runtime_bytes=runtime)
    batch = args.global_batch or hardware.devices
    if batch < 1:
        raise est.EstimateError("--global-batch must be positive")
    dtype = args.dtype
    if args.config:
        workload = planner.workload_from_config(args.config, seq_len=args.seq_len, global_batch=batch, dtype=dtype,
                                                optimizer=args.optimizer, device="cpu" if cpu else "cuda")
    else:
        params = float(args.params)
        if not params > 0:
            raise est.EstimateError(f"--params must be > 0, got {args.params!r}")
        workload = planner.Workload(params=params, seq_len=args.seq_len, global_batch=batch, dtype=dtype,
                                    optimizer=args.optimizer, device="cpu" if cpu else "cuda")
    est.precision_bytes(workload.dtype, workload.optimizer)  # validates both names
    return workload, hardware


def _available_bytes() -> float:
    import psutil

    return float(psutil.virtual_memory().available)


def run(args: argparse.Namespace) -> int:
    """Print the ranked plan; on bad input print one error line to stderr and return 2."""
    try:
        workload, hardware = read_inputs(args)
        rows = planner.plan(workload, hardware, headroom=args.headroom, max_tp=args.max_tp, max_pp=args.max_pp)
        if args.verify and not (hardware.cpu and args.config):
            raise est.EstimateError("--verify runs here: it needs --cpu-ranks and --config")
        measured = read_measurements(args.measured, workload, hardware) if args.measured else None
    except est.EstimateError as exc:
        print(f"hfzero plan: error: {exc}", file=sys.stderr)
        return 2
    result = planner.summary(rows, workload, hardware, headroom=args.headroom)
    if measured is not None:
        result["measured"] = {**measured, "fastest": fastest_that_fits(measured, result["configurations"])}
    if args.verify:
        # --verify runs one data-parallel ZeRO group here: the best configuration without pp, tp or offload
        top = next((row for row in rows if row.fits and row.candidate.pp == row.candidate.tp == 1
                    and not row.candidate.offload), None)
        if top is None:
            print("hfzero plan: error: --verify: no data-parallel configuration fits", file=sys.stderr)
            return 2
        from hfzero.planning.verify import verify

        result["verify"] = verify(args.config, top, workload, steps=args.verify_steps)
        result["verify"]["is_choice"] = result["best"] is not None and top.candidate.label() == result["best"]["label"]
    print(json.dumps(result, indent=2) if args.json else render(result, top=args.top))
    return 0


def render(result: dict[str, Any], *, top: int = 10) -> str:
    """The plan as text: the inputs, the paper's model states per stage, the top configurations that fit,
    and the rejected ones grouped by reason."""
    hw, work = result["hardware"], result["workload"]
    lines = [f"model: {work['params'] / 1e9:.4g}B parameters, seq {work['seq_len']}, global batch "
             f"{work['global_batch']}, {work['dtype']} + {work['optimizer']}",
             f"hardware: {hw['devices']} {'CPU ranks' if hw['cpu'] else 'GPUs'} ({hw['nodes']} node(s)), "
             f"{hw['memory_bytes'] / _GB:.2f} GB each, budget {result['budget_bytes'] / _GB:.2f} GB "
             f"({result['headroom']:.0%} headroom), {hw['flops'] / 1e12:g} TFLOP/s, links "
             f"{hw['intra_bytes_per_s'] / 1e9:g} / {hw['inter_bytes_per_s'] / 1e9:g} GB/s",
             f"model states per device at N_d = {result['devices']} (the paper's formula; GB = 1e9 bytes):"]
    for row in result["stages"]:
        lines.append(f"  stage {row['stage']} {row['name']:<10} {row['model_states_bytes'] / _GB:10.2f} GB  "
                     + ("fits" if row["fits"] else "does not fit") + f" {hw['memory_bytes'] / _GB:.4g} GB"
                     + " (model states alone)")
    fitting = [r for r in result["configurations"] if r["fits"]]
    lines.append(f"{len(fitting)} of {len(result['configurations'])} configurations fit; the fastest first "
                 "(estimated; step time is compute + communication, nothing overlapped):")
    lines.append(f"  {'#':>3} {'configuration':<52}{'peak GB':>9}{'states':>8}{'trans':>7}{'acts':>7}{'rt':>6}{'step s':>9}"
                 f"{'tokens/s':>11}")
    for i, row in enumerate(fitting[:top], 1):
        m = row["memory"]
        lines.append(f"  {i:>3} {row['label']:<52}{m['total'] / _GB:>9.2f}{m['model_states'] / _GB:>8.2f}"
                     f"{m['transient'] / _GB:>7.2f}{m['activations'] / _GB:>7.2f}{m['runtime'] / _GB:>6.2f}{row['step_s']:>9.3g}"
                     f"{row['tokens_per_s']:>11,.0f}")
    best = result["best"]
    lines.append(f"choice: {best['label']}" if best else "choice: none fits; see the reasons below")
    rejected = [r for r in result["configurations"] if not r["fits"]]
    if rejected:
        lines.append(f"{len(rejected)} do not fit, e.g.:")
        for row in rejected[:min(top, 5)]:
            lines.append(f"  {row['label']}: {row['reason']}")
    if "measured" in result:
        lines += _measured_lines(result["measured"])
    if "verify" in result:
        lines += _verify_lines(result["verify"])
    return "\n".join(lines)


def _measured_lines(measured: dict[str, Any]) -> list[str]:
    rounds = measured["rounds"]
    clock = "wall s" if measured["clock"] == "wall" else "CPU s of the busier rank"
    lines = [f"measured by benchmarks/scale.py ({measured['source']}, median of {rounds} round(s), {clock} per step):"]
    ddp = measured["ddp_s"]
    for label, seconds in sorted(measured["by_label"].items(), key=lambda item: item[1]):
        lines.append(f"  {label:<52}{seconds:>9.3f}" + (f"  x{seconds / ddp:.3f} of DDP's" if ddp else ""))
    if ddp:
        lines.append(f"  {'torch DDP (reference)':<52}{ddp:>9.3f}")
    fastest = measured["fastest"]
    lines.append(f"measured fastest that fits: {fastest['label']} ({fastest['step_s']:.3f} s/step; "
                 f"#{fastest['plan_rank']} in the estimated ranking)" if fastest
                 else "measured fastest that fits: none of the measured configurations fits")
    return lines


def _verify_lines(verify: dict[str, Any]) -> list[str]:
    which = "the choice" if verify.get("is_choice", True) else "the best without pp, tp or offload"
    lines = [f"verify ({which}): {verify['label']}, {verify['steps']} steps here (per-rank peak, worst rank, bytes):",
             f"  {'part':<20}{'predicted':>14}{'measured':>14}{'measured/predicted':>20}"]
    predicted, measured = dict(verify["predicted"]), dict(verify["measured"])
    predicted["engine total"] = predicted["total"] - predicted["runtime"]
    measured["engine total"] = measured["total"]
    measured["process peak (RSS)"], predicted["process peak (RSS)"] = measured.get("rss"), predicted["total"]
    for part in ("model_states", "transient", "activations", "engine total", "runtime", "process peak (RSS)"):
        p, m = predicted.get(part), measured.get(part)
        ratio = f"{m / p:.3f}" if p and m is not None else ""
        lines.append(f"  {part:<20}{p or 0:>14,.0f}{m if m is not None else float('nan'):>14,.0f}{ratio:>20}")
    lines.append(f"  measured step time {verify['step_s']:.3f} s (predicted {verify['predicted_step_s']:.3f} s)")
    return lines
