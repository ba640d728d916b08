"""Per-stage figures of a pipeline-parallel profile: memory by role, the bubble, communication.

Pure Python (no torch), like the reader: the dashboard and ``hfzero profile summary`` use it. A run
recorded without pipeline parallelism (or a version-1 file) has no stage table.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from typing import Any, Protocol


class _RankLog(Protocol):
    rank: int
    records: list[dict[str, Any]]

    def of_kind(self, kind: str) -> list[dict[str, Any]]: ...


class ProfileRun(Protocol):
    """What the stage table reads of a run: the reader's ``Run`` (reader.py imports this module, not the reverse)."""

    header: dict[str, Any]
    ranks: Mapping[int, _RankLog]

_TIMES = ("wall_seconds", "busy_seconds", "idle_seconds", "bubble_fraction", "idle_fraction")
"""Clock figures of a step record's ``pipeline`` object summarized by their median."""


def pp_rank_of(records: list[dict[str, Any]]) -> int:
    """The pp rank a rank file's records carry (0 for files without it: no pipeline, or version 1)."""
    for record in records:
        if isinstance(record.get("pp_rank"), int):
            return int(record["pp_rank"])
    return 0


def stage_table(run: ProfileRun) -> list[dict[str, Any]] | None:
    """One row per pp rank, or None when the run has no ``pipeline`` header section.

    Each row: ``pp_rank``, ``stages``, ``ranks`` (global ranks with a file), ``steps`` (step records
    with pipeline figures, over those ranks); memory: ``roles_peak`` (per role, the maximum over the
    stage's ranks and steps), ``model_state_bytes`` (the maximum step peak), ``predicted_roles`` and
    ``predicted_model_state_bytes`` (the cost model's, from the header); the bubble: the medians over
    steps and ranks of ``wall_seconds``, ``busy_seconds``, ``idle_seconds``, ``bubble_fraction``
    (idle / busy) and ``idle_fraction`` (idle / wall), beside ``bubble_estimate`` ((P - 1)/(vM));
    communication: ``comm_elements_per_step`` (the dp collectives of the engine, mean over steps and
    ranks, per kind), ``predicted_comm_elements_per_step``, ``p2p_bytes_per_step`` ({send, recv}, mean)
    and ``p2p_estimate`` (the cost model's for the recorded micro-batches).
    """
    pipeline = run.header.get("pipeline")
    if not isinstance(pipeline, dict):
        return None
    predicted = {entry.get("pp_rank"): entry for entry in pipeline.get("ranks") or [] if isinstance(entry, dict)}
    by_stage: dict[int, list[Any]] = {}
    for log in run.ranks.values():
        by_stage.setdefault(pp_rank_of(log.records), []).append(log)
    rows = []
    for pp_rank in range(int(pipeline.get("pp") or 0) or (max(by_stage, default=-1) + 1)):
        logs = by_stage.get(pp_rank, [])
        steps = [s for log in logs for s in log.of_kind("step")]
        figures = [s["pipeline"] for s in steps if isinstance(s.get("pipeline"), dict)]
        estimate = predicted.get(pp_rank) or {}
        rows.append({
            "pp_rank": pp_rank,
            "stages": estimate.get("stages") or next((f.get("stages") for f in figures), None),
            "ranks": [log.rank for log in logs],
            "steps": len(figures),
            "roles_peak": _roles_peak(steps),
            "model_state_bytes": max((s.get("model_state_bytes") or 0 for s in steps), default=None),
            "predicted_roles": estimate.get("model_states_by_role"),
            "predicted_model_state_bytes": estimate.get("model_state_bytes"),
            **{key: _median(f.get(key) for f in figures) for key in _TIMES},
            "bubble_estimate": next((f.get("bubble_estimate") for f in figures), pipeline.get("bubble_estimate")),
            "comm_elements_per_step": _mean_comm(steps),
            "predicted_comm_elements_per_step": estimate.get("comm_elements_per_step"),
            "p2p_bytes_per_step": _mean_p2p(f.get("p2p") for f in figures),
            "p2p_estimate": next((f.get("p2p_estimate") for f in figures if f.get("p2p_estimate")), None),
        })
    return rows


def _roles_peak(steps: list[dict[str, Any]]) -> dict[str, int]:
    peak: dict[str, int] = {}
    for step in steps:
        for role, nbytes in (step.get("roles") or {}).items():
            peak[role] = max(peak.get(role, 0), nbytes)
    return peak


def _median(values: Any) -> float | None:
    numbers = [v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
    return statistics.median(numbers) if numbers else None


def _mean_comm(steps: list[dict[str, Any]]) -> dict[str, float]:
    """Mean elements per step record by collective kind (a kind absent from a step counts 0)."""
    totals: dict[str, float] = {}
    for step in steps:
        for kind, stats in (step.get("comm") or {}).items():
            totals[kind] = totals.get(kind, 0) + stats.get("elements", 0)
    return {kind: total / len(steps) for kind, total in sorted(totals.items())} if steps else {}


def _mean_p2p(entries: Any) -> dict[str, float] | None:
    found = [e for e in entries if isinstance(e, dict)]
    if not found:
        return None
    return {way: sum((e.get(way) or {}).get("bytes", 0) for e in found) / len(found) for way in ("send", "recv")}
