"""``hfzero profile summary RUN_DIR``: per-rank peak model-state bytes against the paper's formula,
allocator peaks and communication per step of a profile run directory (docs/profile-format.md)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from hfzero.profiler.reader import ProfileFormatError, load_run, summarize


def register(subparsers: Any) -> None:
    """Add the ``profile`` subcommand and its ``summary`` action."""
    parser = subparsers.add_parser(
        "profile", help="read profiles written by hfzero.profiler.ZeroProfiler",
        description="Read profile run directories written by hfzero.profiler.ZeroProfiler.")
    actions = parser.add_subparsers(dest="action", metavar="ACTION")
    summary = actions.add_parser(
        "summary", help="per-rank peak model-state bytes vs the paper's formula, allocator peaks, comm per step",
        description="Summarize a profile run: per rank, the peak model-state bytes beside the estimator's "
        "prediction and their ratio, allocator peaks, and communication per step (sizes in bytes; "
        "kB/MB/GB = 1e3/1e6/1e9).")
    summary.add_argument("run_dir", metavar="RUN_DIR", help="a directory written by ZeroProfiler")
    summary.add_argument("--json", action="store_true",
                         help="print the summary as JSON (top-level stage, world_size, ranks[].model_state_bytes, ...)")
    summary.set_defaults(func=run_summary)
    parser.set_defaults(func=lambda args: _usage(parser))


def _usage(parser: argparse.ArgumentParser) -> int:
    parser.print_help(sys.stderr)
    return 2


def run_summary(args: argparse.Namespace) -> int:
    """Print the summary of ``args.run_dir``; on a bad run directory print one error line and return 2."""
    try:
        summary = summarize(load_run(args.run_dir))
    except (ProfileFormatError, OSError) as exc:
        print(f"hfzero profile summary: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(summary, indent=2))
        return 0
    print(_render(summary))
    for warning in summary["warnings"]:
        print(f"warning: {warning}", file=sys.stderr)
    return 0


def _render(summary: dict[str, Any]) -> str:
    lines = [f"run {summary['run_id']}: {summary['model_class']}, Ψ = {summary['num_params']:,}, "
             f"stage {summary['stage']}, N_d = {summary['world_size']}"]
    prediction = summary["prediction"]
    if summary.get("pipeline"):
        lines.append("predicted model states per rank: per pipeline stage (the stages table below)")
    elif prediction:
        lines.append(f"predicted model states per rank: {_bytes(prediction['model_state_bytes'])} "
                     f"({prediction['formula']})")
    else:
        lines.append("predicted model states per rank: none (optimizer unknown to the estimator)")
    columns = ("rank", "steps", "model states", "predicted", "ratio", "alloc peak", "reserved peak", "frag max",
               "comm elem/step", "comm bytes/step", "step s")
    rows = [columns]
    for rank in summary["ranks"]:
        peak = rank["allocator_peak"]
        rows.append((
            str(rank["rank"]), str(rank["steps"]), _bytes(rank["model_state_bytes"]),
            _bytes(rank["predicted_model_state_bytes"]), _fixed(rank["ratio"], 4), _bytes(peak.get("allocated")),
            _bytes(peak.get("reserved")), _fixed(peak.get("fragmentation"), 3),
            f"{rank['comm_elements_per_step']:,.0f}", _bytes(rank["comm_bytes_per_step"]),
            _fixed(rank["step_seconds"], 4) + (" (crashed)" if rank["truncated"] else "")))
    widths = [max(len(row[i]) for row in rows) for i in range(len(columns))]
    lines += ["  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in rows]
    if summary.get("pipeline"):
        lines += _render_stages(summary["pipeline"])
    return "\n".join(lines)


def _render_stages(stages: list[dict[str, Any]]) -> list[str]:
    """The per-stage table of a pipeline-parallel run (hfzero.profiler.stages.stage_table)."""
    columns = ("pp rank", "ranks", "model states", "predicted", "bubble idle/busy", "(P-1)/(vM)", "idle/wall",
               "dp elem/step", "predicted", "P2P sent/step", "P2P recv/step", "predicted")
    rows = [columns]
    for row in stages:
        p2p, estimate = row["p2p_bytes_per_step"] or {}, row["p2p_estimate"] or {}
        predicted_comm = row["predicted_comm_elements_per_step"]
        rows.append((
            str(row["pp_rank"]), ",".join(map(str, row["ranks"])), _bytes(row["model_state_bytes"]),
            _bytes(row["predicted_model_state_bytes"]), _fixed(row["bubble_fraction"], 3),
            _fixed(row["bubble_estimate"], 3), _fixed(row["idle_fraction"], 3),
            f"{sum(row['comm_elements_per_step'].values()):,.0f}",
            f"{sum(predicted_comm.values()):,.0f}" if predicted_comm is not None else "-",
            _bytes(p2p.get("send")), _bytes(p2p.get("recv")), _bytes(estimate.get("send"))))
    widths = [max(len(row[i]) for row in rows) for i in range(len(columns))]
    return ["pipeline stages (medians over steps and ranks; bubble = idle / busy time in the schedule):",
            *("  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in rows)]


def _bytes(value: float | None) -> str:
    if value is None:
        return "-"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:.3f} {unit}"
    return f"{value:.0f} B"


def _fixed(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"
