"""Step times measured by ``benchmarks/scale.py`` read beside a plan: which configuration that fits ran fastest.

The plan's ranking is a model (compute + communication, nothing overlapped); ``hfzero plan --measured FILE``
puts the benchmark's measured step times next to it and names the fastest measured configuration among
those the plan says fit. Only measurements of the same workload count: the file's world size, tokens per
rank, sequence length and parameter count (within 1%) must be the plan's, otherwise the reader says which
figure differs. Holds no tensor memory.
"""

from __future__ import annotations

import json
import math
from typing import Any

from hfzero.planning.estimate import EstimateError
from hfzero.planning.plan import Candidate, Hardware, Workload

PARAMS_TOLERANCE = 0.01
"""Relative difference in parameter count under which a measured model is the planned one (the plan's
``--config`` count and the benchmark's engine count differ by tied weights and buffers at most)."""


def read_measurements(path: str, work: Workload, hw: Hardware) -> dict[str, Any]:
    """The step times in ``path`` (a ``benchmarks/scale.py --json`` file) for the planned workload.

    Returns ``{"source": path, "rounds": R, "clock": "wall" | "cpu", "by_label": {plan label: seconds},
    "ddp_s": seconds | None}`` (median over the benchmark's rounds; ``clock`` "cpu": the busier rank's CPU
    seconds, which the benchmark records on a machine shared with other work); raises EstimateError naming the mismatch when the file measured
    another world size, batch, sequence length, precision or model size.
    """
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as exc:
        raise EstimateError(f"--measured {path}: cannot read it as JSON ({exc}); give the file "
                            "`python benchmarks/scale.py ... --json FILE` wrote") from exc
    if not isinstance(data, dict) or "rows" not in data or "workload" not in data:
        raise EstimateError(f"--measured {path}: not a benchmarks/scale.py result (no 'rows' / 'workload'); "
                            "rerun the benchmark with this tree to record its workload")
    measured = data["workload"]
    world, per_rank, seq = int(measured["world"]), int(measured["batch_per_rank"]), int(measured["seq_len"])
    if not hw.cpu or hw.devices != world:
        raise EstimateError(f"--measured {path}: measured on {world} CPU ranks; plan with --cpu-ranks {world}")
    if seq != work.seq_len or per_rank * world != work.global_batch:
        raise EstimateError(f"--measured {path}: measured {per_rank} x {seq} tokens per rank (global batch "
                            f"{per_rank * world}); plan with --seq-len {seq} --global-batch {per_rank * world}")
    if measured.get("dtype") != work.dtype:
        raise EstimateError(f"--measured {path}: measured in {measured.get('dtype')}; plan with --dtype "
                            f"{measured.get('dtype')}")
    rows = [r for r in data["rows"] if _same_model(r.get("num_params"), work.params)]
    if not rows:
        sizes = sorted({f"{r.get('size')} ({r.get('num_params')})" for r in data["rows"]})
        raise EstimateError(f"--measured {path}: no measured size has the plan's {work.params:,.0f} parameters "
                            f"(measured: {', '.join(sizes)}); plan that model's config or measure this one")
    by_label: dict[str, float] = {}
    ddp = None
    for row in rows:
        system, seconds = row["system"], float(row["median_step_s"])
        if system == "ddp":
            ddp = seconds
        elif system.startswith("zero"):
            stage = int(system[len("zero"):])
            label = Candidate(stage=stage, dp=world, micro_batch=per_rank, accumulation_steps=1,
                              accumulation="sharded").label()
            by_label[label] = seconds
    return {"source": path, "rounds": int(measured.get("rounds", 1)), "clock": measured.get("clock", "wall"),
            "by_label": by_label, "ddp_s": ddp}


def _same_model(measured: Any, planned: float) -> bool:
    return isinstance(measured, (int, float)) and math.isclose(measured, planned, rel_tol=PARAMS_TOLERANCE)


def fastest_that_fits(measurements: dict[str, Any], configurations: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The measured configuration with the lowest step time among the plan's ``configurations`` that fit,
    as ``{"label", "step_s", "plan_rank"}`` (plan_rank: its place in the plan's ranking of those that fit,
    from 1), or None when no measured configuration fits."""
    fitting = [c["label"] for c in configurations if c["fits"]]
    timed = [(seconds, label) for label, seconds in measurements["by_label"].items() if label in fitting]
    if not timed:
        return None
    seconds, label = min(timed)
    return {"label": label, "step_s": seconds, "plan_rank": fitting.index(label) + 1}
