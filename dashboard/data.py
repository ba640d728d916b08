"""Loading profile runs into tables for plotting: no Streamlit here, so every figure is testable.

Runs are read only through ``hfzero.profiler.reader`` (``load_run``, ``summarize``). A run that
cannot be read becomes a ``LoadedRun`` with ``error`` set (the reader's message naming file and
line), so one bad directory never stops the others from showing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from hfzero.logging import get_logger
from hfzero.profiler.format import HEADER_FILE, PHASES, RANK_FILE_PATTERN
from hfzero.profiler.decompose import ACTIVATION_KEYS, PARTS, legacy_parts
from hfzero.profiler.reader import ProfileFormatError, Run, load_run, summarize
from hfzero.roles import MODEL_STATE_ROLES, MemoryRole

logger = get_logger(__name__)

MODEL_STATE_KEYS: tuple[str, ...] = tuple(r.value for r in MemoryRole if r in MODEL_STATE_ROLES)
"""Model-state role values, in the enum's order."""

TRANSIENT_KEYS: tuple[str, ...] = tuple(r.value for r in MemoryRole if r not in MODEL_STATE_ROLES)
"""Transient role values (buffers, gathered units, checkpoints), in the enum's order."""

ALLOCATOR_KEYS: tuple[str, ...] = (
    "allocated", "reserved", "rss", "rss_peak", "active", "inactive_split", "reserved_unallocated", "fragmentation",
    "heap_arena", "heap_in_use", "heap_free", "heap_mmapped", "total_free", "largest_free_block",
    "snapshot_fragmentation", "num_alloc_retries", "num_ooms",
)
"""Allocator sample fields copied into the tables (absent ones become NaN)."""

MAX_SEARCH_DEPTH = 3
"""How deep ``find_run_dirs`` looks below a parent directory for run directories."""


@dataclasses.dataclass(frozen=True)
class LoadedRun:
    """One run directory as the dashboard sees it.

    Attributes:
        path: the run directory.
        run: the reader's ``Run``, or None when it could not be read.
        summary: ``summarize(run)``, or None with ``run``.
        error: why the run could not be read (the reader's message), else None.
    """

    path: Path
    run: Run | None
    summary: dict[str, Any] | None
    error: str | None

    @property
    def label(self) -> str:
        """A short name: the directory name, with stage and N_d once loaded."""
        if self.run is None:
            return self.path.name
        return f"{self.path.name} (stage {self.run.stage}, N_d={self.run.world_size})"


# --------------------------------------------------------------------------------------------------
# Finding and loading runs
# --------------------------------------------------------------------------------------------------


def is_run_dir(path: Path) -> bool:
    """True when ``path`` looks like a run directory: it holds a header or a rank file."""
    if not path.is_dir():
        return False
    return (path / HEADER_FILE).is_file() or any(RANK_FILE_PATTERN.match(p.name) for p in path.iterdir())


def find_run_dirs(path: Path | str, depth: int = MAX_SEARCH_DEPTH) -> list[Path]:
    """``path`` itself when it is a run directory, else every run directory below it (sorted),
    looking at most ``depth`` levels down. Returns [] when there is none."""
    path = Path(path)
    if is_run_dir(path):
        return [path]
    if depth == 0 or not path.is_dir():
        return []
    found: list[Path] = []
    for child in sorted(p for p in path.iterdir() if p.is_dir() and not p.name.startswith(".")):
        found += find_run_dirs(child, depth - 1)
    return found


def resolve_paths(paths: Iterable[Path | str]) -> tuple[list[Path], list[str]]:
    """Expand run directories and parents of run directories; returns (run dirs, problems).

    Each problem is one line naming a path that does not exist or holds no run directory.
    """
    runs: list[Path] = []
    problems: list[str] = []
    for raw in paths:
        path = Path(raw).expanduser()
        if not path.exists():
            problems.append(f"{path}: no such directory")
        elif not path.is_dir():
            problems.append(f"{path}: not a directory (give a profile run directory or a parent of run directories)")
        else:
            found = find_run_dirs(path)
            if not found:
                problems.append(f"{path}: holds no profile run directory (no {HEADER_FILE} or rank-<r>.jsonl "
                                f"within {MAX_SEARCH_DEPTH} levels)")
            runs += [p for p in found if p not in runs]
    return runs, problems


def run_signature(path: Path | str) -> tuple[tuple[str, int, int], ...]:
    """(name, size, mtime_ns) of the run's header and rank files: changes whenever a file grows,
    so a cache keyed on it reloads a run that is still being written."""
    path = Path(path)
    if not path.is_dir():
        return ()
    entries = []
    for file in sorted(path.iterdir()):
        if file.name == HEADER_FILE or RANK_FILE_PATTERN.match(file.name):
            stat = file.stat()
            entries.append((file.name, stat.st_size, stat.st_mtime_ns))
    return tuple(entries)


def load(path: Path | str) -> LoadedRun:
    """Load and summarize one run directory; a reader error becomes ``LoadedRun.error``."""
    path = Path(path)
    try:
        run = load_run(path)
        summary = summarize(run)
    except ProfileFormatError as err:
        logger.warning("cannot read run %s: %s", path, err)
        return LoadedRun(path=path, run=None, summary=None, error=str(err))
    except Exception as err:  # noqa: BLE001 - whatever one run's files hold, the other runs keep working
        logger.warning("cannot read run %s: %r", path, err)
        return LoadedRun(path=path, run=None, summary=None,
                         error=f"{path}: not a readable hfzero profile ({type(err).__name__}: {err})")
    for warning in run.warnings:
        logger.info("%s", warning)
    return LoadedRun(path=path, run=run, summary=summary, error=None)


# --------------------------------------------------------------------------------------------------
# Tables
# --------------------------------------------------------------------------------------------------


def _number(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return float("nan")
    return float(value)


def _memory_columns(record: dict[str, Any]) -> dict[str, float]:
    roles = record.get("roles") or {}
    allocator = record.get("allocator") or {}
    row = {key: _number(allocator.get(key)) for key in ALLOCATOR_KEYS}
    row.update({f"role:{key}": float(roles.get(key, 0)) for key in (*MODEL_STATE_KEYS, *TRANSIENT_KEYS)})
    for key, value in roles.items():  # roles a newer writer added keep their own column
        row.setdefault(f"role:{key}", _number(value))
    row["model_state_bytes"] = _number(record.get("model_state_bytes"))
    row["transient_bytes"] = float(sum(_number(v) for k, v in roles.items() if k not in MODEL_STATE_KEYS))
    row["activation_bytes"] = float(roles.get(MemoryRole.ACT_CHECKPOINT.value, 0)
                                    + roles.get(MemoryRole.ACTIVATIONS.value, 0))
    return row


def timeline_frame(run: Run) -> pd.DataFrame:
    """One row per phase record of every rank (step records when a rank has no phase records).

    ``x`` places a record on a step axis: the i-th of a step's n records sits at step + i/n, so
    forward, backward and step (and gradient-accumulation micro-batches) are spread inside each step.
    Columns: rank, step, x, t, phase, edge, micro, the allocator fields of ``ALLOCATOR_KEYS``,
    ``role:<value>`` per role, model_state_bytes, transient_bytes, activation_bytes.
    """
    rows: list[dict[str, Any]] = []
    for rank, log in run.ranks.items():
        records = log.of_kind("phase") or log.of_kind("step")
        per_step: dict[int, int] = {}
        for record in records:
            per_step[record["step"]] = per_step.get(record["step"], 0) + 1
        seen: dict[int, int] = {}
        for record in records:
            step = record["step"]
            index = seen.get(step, 0)
            seen[step] = index + 1
            rows.append({
                "rank": rank, "step": step, "x": step + index / per_step[step], "t": float(record["t"]),
                "phase": record.get("phase") or "step", "edge": record.get("edge") or "",
                "micro": record.get("micro"), **_memory_columns(record),
            })
    return _frame(rows, ["rank", "step", "x", "t", "phase", "edge", "micro"])


def step_frame(run: Run) -> pd.DataFrame:
    """One row per step record of every rank: rank, step, t, seconds, phase seconds, the step-end
    allocator fields, ``max:<field>`` for ``allocator_max``, the role peaks and model_state_bytes."""
    rows: list[dict[str, Any]] = []
    for rank, log in run.ranks.items():
        for record in log.of_kind("step"):
            phase_seconds = record.get("phase_seconds") or {}
            row = {"rank": rank, "step": record["step"], "t": float(record["t"]),
                   "seconds": _number(record.get("seconds")), **_memory_columns(record)}
            row.update({f"seconds:{p}": _number(phase_seconds.get(p)) for p in PHASES})
            row.update({f"max:{k}": _number((record.get("allocator_max") or {}).get(k)) for k in ALLOCATOR_KEYS})
            rows.append(row)
    return _frame(rows, ["rank", "step", "t", "seconds"])


def peak_frame(run: Run) -> pd.DataFrame:
    """One row per step record with a ``peak`` (see [Note: peak decomposition]): rank, step, total,
    the parts of ``PARTS``, peak_total (lifetime peak) and where the sampled peak was (phase, edge)."""
    rows = []
    for rank, log in run.ranks.items():
        for record in log.of_kind("step"):
            peak = record.get("peak")
            if isinstance(peak, dict):
                peak = legacy_parts(peak)
                rows.append({"rank": rank, "step": record["step"], "total": _number(peak.get("total")),
                             **{part: _number(peak.get(part)) for part in PARTS},
                             "peak_total": _number(peak.get("peak_total")),
                             "at": f"{peak.get('phase')} {peak.get('edge')}"})
    return _frame(rows, ["rank", "step", "total", *PARTS, "peak_total", "at"])


def comm_frame(run: Run) -> pd.DataFrame:
    """One row per (rank, step, collective kind) of the step records' ``comm``: calls, elements,
    bytes, seconds, and the bytes that cross nodes (``inter_node_bytes``: NaN in profiles before issue 22; see
    docs/multinode.md). Steps without traffic have no rows."""
    rows = []
    for rank, log in run.ranks.items():
        for record in log.of_kind("step"):
            for kind, stats in sorted((record.get("comm") or {}).items()):
                rows.append({"rank": rank, "step": record["step"], "kind": kind,
                             **{f: _number(stats.get(f)) for f in ("calls", "elements", "bytes", "seconds",
                                                                   "inter_node_bytes")}})
    return _frame(rows, ["rank", "step", "kind", "calls", "elements", "bytes", "seconds", "inter_node_bytes"])


def _frame(rows: list[dict[str, Any]], columns: Sequence[str]) -> pd.DataFrame:
    frame = pd.DataFrame(rows)
    if frame.empty:
        return pd.DataFrame(columns=list(columns))
    return frame


def downsample(frame: pd.DataFrame, max_points: int, by: str = "rank") -> tuple[pd.DataFrame, int]:
    """At most about ``max_points`` rows per ``by`` group, keeping peaks.

    Consecutive rows are grouped k at a time (k = ceil(rows / max_points)); each group becomes one
    row with the maximum of every numeric column except the position columns (step, x, t: the
    group's first) so a spike is never averaged away. Returns (frame, k); k = 1 means unchanged.
    """
    if max_points < 1:
        raise ValueError(f"max_points must be positive, got {max_points}")
    if frame.empty:
        return frame, 1
    largest = int(frame.groupby(by).size().max())
    factor = -(-largest // max_points)
    if factor <= 1:
        return frame, 1
    parts = []
    numeric = [c for c in frame.columns if pd.api.types.is_numeric_dtype(frame[c]) and c != by]
    first_cols = [c for c in frame.columns if c not in numeric or c in ("step", "x", "t", "micro")]
    for _, group in frame.groupby(by, sort=True):
        bucket = np.arange(len(group)) // factor
        grouped = group.groupby(bucket, sort=True)
        reduced = grouped[[c for c in numeric if c not in first_cols]].max()
        firsts = grouped[first_cols].first()
        parts.append(pd.concat([firsts, reduced], axis=1)[list(frame.columns)])
    return pd.concat(parts, ignore_index=True), factor


# --------------------------------------------------------------------------------------------------
# Figures of the paper for a run
# --------------------------------------------------------------------------------------------------


def peak_roles(run: Run) -> dict[int, dict[str, float]]:
    """Per rank, the roles of the record where model states peak (ties: the most bytes in all).

    The model-state roles of that record add up to the rank's measured ``model_state_bytes`` peak;
    the transient roles show what else the engine held at that moment.
    """
    peaks: dict[int, dict[str, float]] = {}
    for rank, log in run.ranks.items():
        best: tuple[float, float] | None = None
        for record in log.records:
            roles = record.get("roles") or {}
            key = (_number(record.get("model_state_bytes")), float(sum(_number(v) for v in roles.values())))
            if not np.isnan(key[0]) and (best is None or key > best):
                best, peaks[rank] = key, {k: float(v) for k, v in roles.items()}
    return peaks


def whole_peak(run: Run) -> dict[int, dict[str, float]]:
    """Per rank, the recorded step peak with the largest ``total`` (see [Note: peak decomposition]):
    total, its parts, and ``overhead`` = other + remainder (the peak minus every role: live tensors no
    role accounts for, allocator caching and fragmentation, libraries). Ranks without one are absent."""
    frame = peak_frame(run)
    out: dict[int, dict[str, float]] = {}
    for rank, group in (frame.groupby("rank", sort=True) if not frame.empty else ()):
        row = group.loc[group["total"].idxmax()]
        parts = {part: float(np.nan_to_num(row[part])) for part in PARTS}
        out[int(rank)] = {"total": float(row["total"]), **parts, "overhead": parts["other"] + parts["remainder"],
                          "step": int(row["step"])}
    return out


OVERHEAD_PARTS: tuple[tuple[str, str], ...] = (
    ("untracked", "untracked live memory"),
    ("runtime", "framework runtime"),
    ("slack", "allocator slack and the rest"),
)
"""(key, label) of the parts ``overhead_split`` divides "other / allocator overhead" into."""


def overhead_split(run: Run) -> dict[int, dict[str, float]]:
    """Per rank, the part of its whole peak (``whole_peak``) outside the engine's roles, decomposed where
    the profile allows it:

    - ``untracked``: allocated memory no role accounts for (the peak's ``other``: input batches,
      optimizer temporaries, communication library buffers allocated through the same allocator);
    - ``runtime``: on a CPU rank, the framework's own resident memory (interpreter, torch and its
      libraries), measured once per process: RSS minus the malloc heap at the start record; 0 on CUDA,
      where the context lives outside the allocator's reserved bytes;
    - ``slack``: the rest of the peak's ``remainder``: bytes the allocator holds free (cache,
      fragmentation, freed heap not yet returned), plus whatever else the process grew by.
    The three add up to ``whole_peak``'s ``overhead``. Ranks without a peak are absent."""
    out: dict[int, dict[str, float]] = {}
    for rank, peak in whole_peak(run).items():
        start = run.ranks[rank].start or {}
        allocator = start.get("allocator") or {}
        rss, reserved = _number(allocator.get("rss")), _number(allocator.get("reserved"))
        cuda = allocator.get("device") not in (None, "cpu") or allocator.get("peak_reserved") is not None
        runtime = 0.0 if cuda or np.isnan(rss) or np.isnan(reserved) else max(0.0, rss - reserved)
        runtime = min(runtime, peak["remainder"])
        out[rank] = {"untracked": peak["other"], "runtime": runtime, "slack": peak["remainder"] - runtime}
    return out


def activation_peaks(run: Run) -> dict[int, dict[str, float]]:
    """Per rank, the measured activation roles' peaks over the step records (``activations`` and
    ``act_checkpoint``: both peak at a forward's end), for comparison with the header's estimate."""
    peaks: dict[int, dict[str, float]] = {}
    for rank, log in run.ranks.items():
        for record in log.of_kind("step"):
            roles = record.get("roles") or {}
            for key in ACTIVATION_KEYS & roles.keys():
                value = _number(roles[key])
                if not np.isnan(value):
                    peaks.setdefault(rank, {k: 0.0 for k in sorted(ACTIVATION_KEYS)})
                    peaks[rank][key] = max(peaks[rank][key], value)
    return peaks


def activation_prediction(run: Run) -> dict[str, Any] | None:
    """The header's ``activation_prediction`` (the estimator's decoder activation model), or None."""
    prediction = run.header.get("activation_prediction")
    return prediction if isinstance(prediction, dict) and isinstance(prediction.get("saved"), (int, float)) else None


def prediction_inputs(run: Run) -> dict[str, Any] | None:
    """The header's ``prediction.inputs`` (Ψ, N_d, stage, p, g, K, persistent), or None."""
    prediction = run.header.get("prediction")
    if not isinstance(prediction, dict) or not isinstance(prediction.get("inputs"), dict):
        return None
    return prediction["inputs"]


def comm_theory_elements(run: Run) -> float | None:
    """The paper's communication volume per step in elements, for the run's accumulation policy.

    One reduction per step ("local" accumulation, or one micro-batch): 2Ψ for stages 0-2 (all-reduce,
    or reduce-scatter + all-gather), 3Ψ for stage 3 (two parameter all-gathers and one reduce-scatter).
    With n micro-batches per step, "sharded" reduces every micro-batch (n reductions) and stage 3
    gathers for every micro-batch (2n). At stage 3 the P persistent parameters (kept whole, see the
    header's prediction inputs) are not gathered: their update is all-gathered once per step.
    Partitioned frozen parameters Ψ_f - P_f are gathered twice per micro-batch (forward and backward)
    and never reduced. Ψ is the header's unpadded trainable count; None when it lacks it.
    """
    model = run.header.get("model") or {}
    psi = model.get("num_params")
    if not isinstance(psi, (int, float)):
        return None
    micro, policy = accumulation_of(run)
    reductions = 1 if policy == "local" else micro
    if run.stage == 0:
        return 2 * float(psi) * reductions
    if run.stage != 3:
        return float(psi) * (reductions + 1)
    frozen, frozen_whole = model.get("num_frozen_params") or 0, model.get("num_frozen_persistent_params") or 0
    persistent = ((prediction_inputs(run) or {}).get("persistent_params") or 0) - frozen_whole
    return (float(psi) * reductions + 2 * micro * (float(psi) - persistent) + float(persistent)
            + 2 * micro * float(frozen - frozen_whole))


def accumulation_of(run: Run) -> tuple[int, str]:
    """(micro-batches per step, policy) from the header; (1, the stage's default) for older profiles."""
    block = run.header.get("accumulation")
    block = block if isinstance(block, dict) else {}
    steps = block.get("steps")
    steps = steps if isinstance(steps, int) and not isinstance(steps, bool) and steps >= 1 else 1
    policy = block.get("policy") if block.get("policy") in ("sharded", "local") else (
        "sharded" if run.stage >= 2 else "local")
    return steps, policy


def sp_group_rows(summary: dict[str, Any] | None) -> list[dict[str, Any]]:
    """One row per sequence-parallel rank (``sp_rank``, issue 23) over the data-parallel replicas: the ranks that
    hold the same chunk position of every sequence, their largest model states and activations (the
    ``activations`` + ``act_checkpoint`` roles at their peak), their mean all-to-all bytes per step (the SP
    attention's) and median step time. Empty when no rank recorded an ``sp_rank`` (no sequence parallelism)."""
    ranks = [r for r in (summary or {}).get("ranks", []) if r.get("sp_rank") is not None]
    rows = []
    for sp_rank in sorted({r["sp_rank"] for r in ranks}):
        group = [r for r in ranks if r["sp_rank"] == sp_rank]
        acts = [sum(r["roles_peak"].get(k, 0) for k in ("activations", "act_checkpoint")) for r in group]
        seconds = sorted(r["step_seconds"] for r in group if r.get("step_seconds") is not None)
        rows.append({
            "sp rank": sp_rank, "ranks": ", ".join(str(r["rank"]) for r in group),
            "dp replicas": ", ".join(str(r["dp_rank"]) for r in group),
            "model states, max (bytes)": max((r["model_state_bytes"] or 0) for r in group),
            "activations + checkpoints, max (bytes)": max(acts),
            "all-to-all bytes / step, mean": float(np.mean([r["comm_per_step"].get("all_to_all", {}).get("bytes", 0)
                                                            for r in group])),
            "step seconds, median": seconds[len(seconds) // 2] if seconds else None,
        })
    return rows
