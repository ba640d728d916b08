"""Plotly figures of a profile run, built from the tables of ``dashboard.data`` (no Streamlit).

Bytes are plotted as bytes with SI tick labels ("1.2MB"); element counts as counts. Every trace has a
hover template naming rank, step and phase where they apply.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.colors import qualitative
from plotly.subplots import make_subplots

from dashboard.data import (OVERHEAD_PARTS, LoadedRun, activation_peaks, activation_prediction, comm_theory_elements,
                            overhead_split, peak_roles, prediction_inputs, whole_peak)
from hfzero.planning import estimate as est
from hfzero.logging import get_logger
from hfzero.roles import MODEL_STATE_ROLES, MemoryRole

logger = get_logger(__name__)

_PALETTE = qualitative.Plotly + qualitative.D3
ROLE_COLORS: dict[str, str] = {role.value: _PALETTE[i % len(_PALETTE)] for i, role in enumerate(MemoryRole)}
"""One fixed color per memory role, in the enum's order."""

TIMELINE_METRICS: tuple[tuple[str, str], ...] = (
    ("allocated", "allocated"),
    ("reserved", "reserved"),
    ("rss", "RSS (process resident)"),
    ("model_state_bytes", "model states"),
    ("transient_bytes", "transient roles (buckets, gathered, buffers)"),
    ("activation_bytes", "activations (saved for backward + checkpoints)"),
)
"""(column, label) of the timeline's candidate panels; a panel is drawn when its column has data."""

_BYTES_AXIS = {"tickformat": "~s", "ticksuffix": "B"}


def role_label(value: str) -> str:
    """``param_full`` -> ``param_full (model state)``; transient roles and unknown keys as they are."""
    try:
        role = MemoryRole(value)
    except ValueError:
        return value
    return f"{role.value} (model state)" if role in MODEL_STATE_ROLES else role.value


def _rank_color(rank: int) -> str:
    return _PALETTE[rank % len(_PALETTE)]


def _has_data(frame: pd.DataFrame, column: str) -> bool:
    return column in frame.columns and bool(frame[column].notna().any()) and bool((frame[column].fillna(0) != 0).any())


# --------------------------------------------------------------------------------------------------
# Memory by role against the paper's formula
# --------------------------------------------------------------------------------------------------


def formula_parts(run: Any) -> est.ModelStateBytes | None:
    """The paper's parameters / gradients / K bytes per rank for the run's header prediction."""
    inputs = prediction_inputs(run)
    if inputs is None:
        return None
    try:
        return est.model_states_breakdown(
            inputs["num_params"], inputs["dp"], inputs["stage"], param_bytes=inputs["param_bytes"],
            grad_bytes=inputs["grad_bytes"], optimizer_k=inputs["optimizer_k"],
            persistent_params=inputs.get("persistent_params") or 0, frozen_params=inputs.get("frozen_params") or 0)
    except (KeyError, TypeError, est.EstimateError) as err:
        logger.warning("cannot evaluate the header's prediction inputs %s: %s", inputs, err)
        return None


MODEL_STATES, FORMULA, TRANSIENT, ACTIVATIONS, ESTIMATE = (
    "model states", "formula", "transient", "activations", "estimate")
"""The bars of each rank in the memory-by-role figure's left panel, left to right."""

_ACTIVATION_ROLES = (MemoryRole.ACTIVATIONS.value, MemoryRole.ACT_CHECKPOINT.value)
_ESTIMATE_PARTS = (("layers", "layers (no checkpointing)"), ("checkpoints", "checkpoints on the device"),
                   ("checkpoints_host", "checkpoints in host memory"), ("head", "outside the layers"))


def _process_peak(entry: dict[str, Any]) -> tuple[str, float] | None:
    """The rank's process-wide peak: CUDA allocated bytes, else the CPU resident set (RSS)."""
    peaks = entry.get("allocator_peak") or {}
    for key, label in (("allocated", "allocated"), ("rss", "RSS")):
        if isinstance(peaks.get(key), (int, float)):
            return label, float(peaks[key])
    return None


def _overhead(run: Any, summary: dict[str, Any], peaks: dict[int, dict[str, float]]) -> dict[int, float]:
    """Per rank, the rank's peak minus its roles: the profiler's peak decomposition (other + remainder
    at the step peak with the largest total), else (older profiles) the process peak less the roles."""
    split = whole_peak(run)
    by_rank = {entry["rank"]: entry for entry in summary["ranks"]}
    out = {}
    for rank in peaks:
        if rank in split:
            out[rank] = split[rank]["overhead"]
        elif (process := _process_peak(by_rank.get(rank, {}))) is not None:
            out[rank] = max(0.0, process[1] - sum(peaks[rank].values()))
    return out


def memory_by_role_figure(loaded: LoadedRun) -> go.Figure:
    """Two panels, each on its own bytes axis, so model states stay readable beside a large overhead.

    Left, per rank, the engine's bytes beside their predictions:
    - "model states": the measured model-state roles at the record where they peak, stacked (what the
      paper's formula counts), with "formula" (the paper's pΨ / gΨ / KΨ, hatched) beside it and the
      measured/formula ratio over the pair;
    - "transient": what else the engine held at that moment (gradient buckets, gathered stage-3 units,
      fp32 gradients, communication buffers), never mixed into the model-state bar;
    - "activations": the measured activation roles (saved for backward, checkpoints) at their peak, with
      "estimate" (the header's ``activation_prediction``: the estimator's activation model) beside it.
    Right, per rank, the whole peak (RSS on a CPU, reserved on CUDA; the profiler's peak decomposition,
    see [Note: peak decomposition]): the engine's roles at that moment, then "other / allocator overhead"
    split by ``data.overhead_split`` into untracked live memory, the framework's runtime and allocator slack.

    The legend (``legend_html``, drawn under the chart) has three groups (measured, by role; predicted;
    whole peak), one entry per role and one for each prediction; the category labels are vertical with a
    bottom margin sized for them, so none is cut or skipped at any width.
    """
    run, summary = loaded.run, loaded.summary
    assert run is not None and summary is not None, "memory_by_role_figure needs a loaded run"
    peaks = peak_roles(run)
    acts = activation_peaks(run)
    predicted = activation_prediction(run)
    parts = formula_parts(run)
    ranks = sorted(peaks)
    kinds = ([MODEL_STATES] + ([FORMULA] if parts is not None else []) + [TRANSIENT]
             + ([ACTIVATIONS] if acts or predicted else []) + ([ESTIMATE] if predicted else []))
    x = [[f"rank {r}" for r in ranks for _ in kinds], [k for _ in ranks for k in kinds]]
    fig = make_subplots(rows=1, cols=2, column_widths=[0.7, 0.3], horizontal_spacing=0.06,
                        subplot_titles=("engine vs prediction", "whole peak"))

    def bar(name: str, values: dict[int, float], kind: str, **style: Any) -> None:
        y = [values.get(r, 0.0) if k == kind else 0.0 for r in ranks for k in kinds]
        if any(y):
            fig.add_bar(x=x, y=y, name=name, hovertemplate=f"{name}<br>%{{x}}<br>%{{y:,.0f}} bytes (%{{y:.3s}}B)"
                                                          "<extra></extra>", row=1, col=1, **style)

    def ratio_text(kind: str, tops: list[float], texts: list[str], name: str) -> None:
        fig.add_scatter(x=[[f"rank {r}" for r in ranks], [kind] * len(ranks)], y=tops, mode="text", text=texts,
                        textposition="top center", name=name, hoverinfo="skip", showlegend=False, cliponaxis=False,
                        textfont={"size": 11}, row=1, col=1)

    measured_group = {"legendgroup": "measured", "legendgrouptitle_text": "measured, by role"}
    keys = [r.value for r in MemoryRole] + sorted({k for p in peaks.values() for k in p} - {r.value for r in MemoryRole})
    is_state = {r.value for r in MODEL_STATE_ROLES}
    for key in keys:
        if key in _ACTIVATION_ROLES:
            values, kind = {r: acts.get(r, {}).get(key, 0.0) for r in ranks}, ACTIVATIONS
        else:
            values = {r: peaks[r].get(key, 0.0) for r in ranks}
            kind = MODEL_STATES if key in is_state else TRANSIENT
        bar(role_label(key), values, kind, marker_color=ROLE_COLORS.get(key), **measured_group)
    if parts is not None:
        _legend_entry(fig, "formula pΨ + gΨ + KΨ (hatched)", "formula", "lightgray", "/", "predicted")
        for name, value, pattern in (("parameters pΨ", parts.params, "/"), ("gradients gΨ", parts.grads, "\\"),
                                     ("optimizer states KΨ", parts.optimizer, "x")):
            bar(f"formula: {name}", {r: value for r in ranks}, FORMULA, marker_color="lightgray",
                marker_pattern_shape=pattern, legendgroup="formula", showlegend=False)
    if predicted:
        _legend_entry(fig, "activation estimate (parts on hover)", "estimate", "gainsboro", "",
                      None if parts is not None else "predicted")
        for key, label in _ESTIMATE_PARTS:
            bar(f"estimate: {label}", {r: float(predicted.get(key) or 0.0) for r in ranks}, ESTIMATE,
                marker_color="gainsboro", legendgroup="estimate", showlegend=False)
        measured = {r: sum(acts[r].values()) for r in ranks if r in acts}  # none with activations=False
        ratio_text(ESTIMATE, [max(measured.get(r, 0.0), predicted["saved"]) for r in ranks],
                   [f"{measured[r] / predicted['saved']:.3f}"
                    if r in measured and predicted["saved"] else "" for r in ranks],
                   "activations: measured / estimate")
    if parts is not None:
        ratios = [summary_ratio(summary, r) for r in ranks]
        tops = [max(sum(v for k, v in peaks[r].items() if k in is_state), sum(parts)) for r in ranks]
        ratio_text(FORMULA, tops, [f"{q:.3f}" if q is not None else "" for q in ratios],
                   "model states: measured / formula")
    _whole_peak_bars(fig, run, summary, peaks)
    prediction = run.header.get("prediction") or {}
    formula = prediction.get("formula") or "no prediction in the header"
    fig.update_layout(barmode="stack", height=640, hovermode="closest",
                      title=f"Bytes by role, stage {run.stage}, N_d={run.world_size}<br><sup>formula {formula}</sup>",
                      showlegend=False,  # the legend is HTML under the chart (legend_html): it wraps at any width
                      margin={"t": 90, "r": 20, "b": 40 + 7 * max(map(len, kinds)) + 30})
    fig.update_yaxes(**_BYTES_AXIS, automargin=True)
    fig.update_yaxes(title_text="bytes per rank", row=1, col=1)
    # vertical category labels never collide at any width; the bottom margin holds them and the rank row
    # below (plotly's automargin under-measures a rotated multi-category axis, so it is set as well)
    fig.update_xaxes(automargin=True)
    fig.update_xaxes(tickangle=-90, dtick=1, row=1, col=1)  # every category named, however narrow
    fig.update_yaxes(side="right", row=1, col=2)  # keeps the gap between the panels free for the ratios
    return fig


_LEGEND_TITLES = {"measured": "measured, by role", "formula": "predicted", "estimate": "predicted",
                  "peak": "whole peak"}


def legend_html(fig: go.Figure) -> str:
    """The memory-by-role figure's legend as HTML lines, one per group (measured, by role; predicted; whole
    peak), each entry a color swatch and its name. Drawn under the chart instead of plotly's legend, so it
    wraps with the page and never covers or squeezes the axes, whatever the width."""
    import html

    groups: dict[str, list[str]] = {}
    for t in fig.data:
        if t.type != "bar" or t.showlegend is False or t.legendgroup not in _LEGEND_TITLES:
            continue
        color = t.marker.color or "gray"
        fill = (f"repeating-linear-gradient(45deg, {color} 0 2px, white 2px 5px)" if t.marker.pattern.shape
                else color)
        swatch = (f'<span style="display:inline-block;width:0.9em;height:0.9em;vertical-align:middle;'
                  f'border:1px solid #aaa;background:{fill}"></span>')
        groups.setdefault(_LEGEND_TITLES[t.legendgroup], []).append(
            f'<span style="white-space:nowrap;margin-right:1em">{swatch} {html.escape(t.name)}</span>')
    lines = [f"<b>{title}:</b> " + " ".join(items) for title, items in groups.items()]
    lines.append("The numbers over the formula and estimate bars are measured / predicted.")
    return "<div style='line-height:1.8'>" + "<br>".join(lines) + "</div>"


def summary_ratio(summary: dict[str, Any], rank: int) -> float | None:
    """The rank's measured / formula model-state ratio from the profile summary, or None."""
    entry = next((e for e in summary["ranks"] if e["rank"] == rank), {})
    return entry.get("ratio")


def _legend_entry(fig: go.Figure, name: str, group: str, color: str, pattern: str, title: str | None = None) -> None:
    """One legend item standing for a group of traces (a prediction's parts), drawing nothing."""
    fig.add_bar(x=[None], y=[None], name=name, legendgroup=group, legendgrouptitle_text=title,
                marker_color=color, marker_pattern_shape=pattern, hoverinfo="skip", row=1, col=1)


_PEAK_COLORS = {"engine": "#6c7a89", "untracked": "#c9b27c", "runtime": "#9fb7c9", "slack": "#e3e3e3"}


def _whole_peak_bars(fig: go.Figure, run: Any, summary: dict[str, Any], peaks: dict[int, dict[str, float]]) -> None:
    """The right panel: per rank, the engine's roles at the whole peak, then the rest of the peak split
    into untracked live memory, framework runtime and allocator slack (older profiles: one "other" bar)."""
    split, whole = overhead_split(run), whole_peak(run)
    ranks = sorted(set(peaks) | set(whole))
    x = [f"rank {r}" for r in ranks]
    group = {"legendgroup": "peak", "legendgrouptitle_text": "the rank's whole peak"}
    engine = {r: whole[r]["model_states"] + whole[r]["transient"] + whole[r]["activations"] if r in whole
              else sum(peaks.get(r, {}).values()) for r in ranks}

    def add(name: str, values: dict[int, float], color: str) -> None:
        fig.add_bar(x=x, y=[values.get(r, 0.0) for r in ranks], name=name, marker_color=color, row=1, col=2,
                    hovertemplate=f"{name}<br>%{{x}}<br>%{{y:,.0f}} bytes (%{{y:.3s}}B)<extra></extra>", **group)

    add("engine roles (the left panel)", engine, _PEAK_COLORS["engine"])
    if split:
        for key, label in OVERHEAD_PARTS:
            add(label, {r: split[r][key] for r in split}, _PEAK_COLORS[key])
    else:
        add("other / allocator overhead (the peak minus the roles)", _overhead(run, summary, peaks), _PEAK_COLORS["slack"])


def peak_sentence(loaded: LoadedRun, tolerance: float = 0.10) -> str:
    """One sentence under the chart: whether the run is within its prediction (model states against the
    formula, activations against the estimate, each within ``tolerance``) and where the rest of the worst
    rank's peak went."""
    run, summary = loaded.run, loaded.summary
    assert run is not None and summary is not None
    checks = []
    ratios = [e.get("ratio") for e in summary["ranks"] if e.get("ratio") is not None]
    if ratios:
        checks.append(("model states", max(ratios, key=lambda q: abs(q - 1)), "formula"))
    predicted, acts = activation_prediction(run), activation_peaks(run)
    if predicted and predicted.get("saved") and acts:
        worst = max((sum(a.values()) / predicted["saved"] for a in acts.values()), key=lambda q: abs(q - 1))
        checks.append(("activations", worst, "estimate"))
    if checks:
        within = all(abs(q - 1) <= tolerance for _, q, _ in checks)
        verdict = ("Within its prediction" if within else "Not within its prediction") + " (" + ", ".join(
            f"{name} {q:.3f} of the {what}" for name, q, what in checks) + f"; ±{tolerance:.0%})"
    else:
        verdict = "No prediction in this profile"
    whole, split = whole_peak(run), overhead_split(run)
    if not whole:
        return verdict + "; no peak decomposition recorded."
    rank = max(whole, key=lambda r: whole[r]["total"])
    peak = whole[rank]
    engine = peak["model_states"] + peak["transient"] + peak["activations"]
    rest = ", ".join(f"{_mb(split[rank][key])} {label}" for key, label in OVERHEAD_PARTS) if rank in split else ""
    return (f"{verdict}; rank {rank}'s peak of {_mb(peak['total'])} is {_mb(engine)} of engine roles (model states "
            f"{_mb(peak['model_states'])}, transient {_mb(peak['transient'])}, activations {_mb(peak['activations'])}) "
            f"and {_mb(peak['overhead'])} outside them" + (f": {rest}." if rest else "."))


def _mb(value: float) -> str:
    """Bytes in MB, or in kB below 1 MB (a small model's roles on a GPU would all read "0 MB")."""
    return f"{value / 1e6:,.0f} MB" if value == 0 or abs(value) >= 1e6 else f"{value / 1e3:,.0f} kB"


def whole_peak_rows(loaded: LoadedRun) -> list[dict[str, Any]]:
    """One row per rank accounting for its whole peak (the parts add up to ``peak``), with the
    measured activations beside the estimator's figure."""
    assert loaded.run is not None
    split, acts, predicted = whole_peak(loaded.run), activation_peaks(loaded.run), activation_prediction(loaded.run)
    rows = []
    for rank in sorted(set(split) | set(acts)):
        peak = split.get(rank, {})
        measured = sum(acts.get(rank, {}).values()) if rank in acts else None
        estimate = float(predicted["saved"]) if predicted else None
        rows.append({"rank": rank, "step": peak.get("step"), "peak (bytes)": peak.get("total"),
                     "model states": peak.get("model_states"), "transient": peak.get("transient"),
                     "activations + checkpoints": peak.get("activations"),
                     "other / allocator overhead": peak.get("overhead"),
                     "activations measured (peak)": measured, "activations estimate": estimate,
                     "measured / estimate": measured / estimate if measured is not None and estimate else None})
    return rows


# --------------------------------------------------------------------------------------------------
# Timeline and fragmentation
# --------------------------------------------------------------------------------------------------


_PART_LABELS = {"model_states": "model states", "transient": "transient buffers",
                "activations": "activations and checkpoints (measured)",
                "other": "other live tensors (no role)", "remainder": "free but held, libraries"}


def peak_decomposition_figure(frame: pd.DataFrame, rank: int) -> go.Figure:
    """Stacked bars per step: the rank's sampled peak split into model states, transient buffers,
    measured activations, other live tensors and the remainder, with the lifetime peak as a line (it grows when the run does)."""
    frame = frame[frame["rank"] == rank] if not frame.empty else frame
    if frame.empty:
        return _empty("No peak decomposition in this run (profiles written before issue 14 lack it).")
    fig = go.Figure()
    for part, label in _PART_LABELS.items():
        fig.add_trace(go.Bar(x=frame["step"], y=frame[part], name=label))
    if frame["peak_total"].notna().any():
        fig.add_trace(go.Scatter(x=frame["step"], y=frame["peak_total"], name="lifetime peak (VmHWM / peak reserved)",
                                 mode="lines+markers", line={"color": "black"}))
    fig.update_layout(barmode="stack", height=380, title=f"Rank {rank}: why the peak (sampled at phase boundaries)",
                      xaxis_title="step")
    fig.update_yaxes(**_BYTES_AXIS)
    return fig


def _hover(frame: pd.DataFrame) -> tuple[np.ndarray, str]:
    custom = np.stack([frame["rank"].astype(str), frame["step"].astype(str), frame["phase"].astype(str),
                       frame["edge"].astype(str), frame["t"].map(lambda t: f"{t:.4f}")], axis=-1)
    template = ("rank %{customdata[0]}, step %{customdata[1]}<br>%{customdata[2]} %{customdata[3]}, "
                "t=%{customdata[4]} s<br>")
    return custom, template


def _ranked_lines(fig: go.Figure, frame: pd.DataFrame, column: str, label: str, row: int, *,
                  legend: bool, unit: str = "bytes", dash: str | None = None, suffix: str = "") -> None:
    for rank, group in frame.groupby("rank", sort=True):
        custom, template = _hover(group)
        value = "%{y:,.0f} bytes (%{y:.3s}B)" if unit == "bytes" else "%{y:.4g}"
        fig.add_scatter(x=group["x"], y=group[column], mode="lines", name=f"rank {rank}{suffix}",
                        legendgroup=f"rank {rank}{suffix}", showlegend=legend,
                        line={"color": _rank_color(int(rank)), "dash": dash}, customdata=custom,
                        hovertemplate=template + f"{label}: {value}<extra></extra>", row=row, col=1)


def timeline_figure(frame: pd.DataFrame, *, factor: int = 1, metrics: Sequence[str] | None = None) -> go.Figure:
    """One panel per metric (allocated, reserved, RSS, model states, transient roles, activations:
    those with data), one line per rank, x = step (phases spread inside each step)."""
    wanted = [(c, lbl) for c, lbl in TIMELINE_METRICS if (metrics is None or c in metrics) and _has_data(frame, c)]
    if not wanted:
        return _empty("No memory figures in the records of this run.")
    fig = make_subplots(rows=len(wanted), cols=1, shared_xaxes=True, vertical_spacing=0.04,
                        subplot_titles=[lbl for _, lbl in wanted])
    for row, (column, label) in enumerate(wanted, 1):
        _ranked_lines(fig, frame, column, label, row, legend=row == 1)
        fig.update_yaxes(**_BYTES_AXIS, row=row, col=1)
    note = f" (downsampled: each point is the max over {factor} records)" if factor > 1 else ""
    fig.update_xaxes(title_text="step (forward, backward, step phases inside each step)", row=len(wanted), col=1)
    fig.update_layout(height=max(320, 220 * len(wanted)), title=f"Memory over steps and phases, per rank{note}",
                      hovermode="closest")
    return fig


def fragmentation_figure(timeline: pd.DataFrame, steps: pd.DataFrame, *, factor: int = 1) -> tuple[go.Figure, list[str]]:
    """Fragmentation over time: the ratio (CPU: free heap / heap; CUDA: free blocks inside segments in use /
    reserved), the largest free block and the free memory's scatter (CUDA snapshots), free vs in-use bytes
    (reserved - allocated vs allocated) and, on CUDA, allocator retries and OOMs.

    Returns the figure and one note per panel left out for lack of data.
    """
    panels: list[tuple[str, pd.DataFrame, list[tuple[str, str, str, str | None]]]] = []
    notes: list[str] = []
    if not steps.empty and "phase" not in steps.columns:  # step records sit at their step's end
        steps = steps.assign(phase="step", edge="end", x=steps["step"] + 1.0)
    ratio_source = timeline if _has_data(timeline, "fragmentation") else steps
    if _has_data(ratio_source, "fragmentation"):
        panels.append(("fragmentation ratio (free but held / held)", ratio_source,
                       [("fragmentation", "fragmentation", "ratio", None)]))
    else:
        notes.append("fragmentation ratio: not recorded (CPU needs glibc mallinfo2)")
    if _has_data(steps, "largest_free_block"):
        panels.append(("largest free block vs total free (CUDA snapshot)", steps,
                       [("largest_free_block", "largest free block", "bytes", None),
                        ("total_free", "total free", "bytes", "dot")]))
        if _has_data(steps, "snapshot_fragmentation"):
            panels.append(("free memory's scatter: 1 - largest free block / total free (CUDA snapshot)", steps,
                           [("snapshot_fragmentation", "scatter", "ratio", None)]))
    else:
        notes.append("largest free block: only with a CUDA allocator snapshot (ZeroProfiler(cuda_snapshot=True))")
    if _has_data(timeline, "reserved") and _has_data(timeline, "allocated"):
        free = timeline.assign(free=timeline["reserved"] - timeline["allocated"])
        panels.append(("in use (allocated) vs free but held (reserved - allocated)", free,
                       [("allocated", "in use", "bytes", None), ("free", "free but held", "bytes", "dot")]))
    else:
        notes.append("free vs in use: the allocator samples have no allocated/reserved figures")
    if _has_data(steps, "rss_peak"):
        panels.append(("process peak RSS (VmHWM) at each step's end: grows when the heap fragments", steps,
                       [("rss_peak", "peak RSS", "bytes", None)]))
    retries = [c for c in ("num_alloc_retries", "num_ooms") if _has_data(timeline, c)]
    if retries:
        panels.append(("allocator retries and OOMs (cumulative, CUDA)", timeline,
                       [(c, c, "count", None if c == "num_alloc_retries" else "dot") for c in retries]))
    elif "num_alloc_retries" in timeline.columns and timeline["num_alloc_retries"].notna().any():
        notes.append("allocator retries and OOMs: none (all zero)")
    else:
        notes.append("allocator retries and OOMs: CUDA only")
    if not panels:
        return _empty("No fragmentation figures in this run."), notes
    fig = make_subplots(rows=len(panels), cols=1, shared_xaxes=True, vertical_spacing=0.06,
                        subplot_titles=[title for title, _, _ in panels])
    for row, (_, frame, series) in enumerate(panels, 1):
        for index, (column, label, unit, dash) in enumerate(series):
            suffix = "" if index == 0 else f" {label}"
            _ranked_lines(fig, frame, column, label, row, legend=row == 1 or index > 0, unit=unit, dash=dash,
                          suffix=suffix)
        fig.update_yaxes(**(_BYTES_AXIS if series[0][2] == "bytes" else {}), row=row, col=1)
    note = f" (downsampled: each point is the max over {factor} records)" if factor > 1 else ""
    fig.update_xaxes(title_text="step", row=len(panels), col=1)
    fig.update_layout(height=max(320, 240 * len(panels)), title=f"Fragmentation over time, per rank{note}")
    return fig, notes


# --------------------------------------------------------------------------------------------------
# Communication
# --------------------------------------------------------------------------------------------------


_COMM_SECONDS_TITLE = {
    "cuda_event": "device seconds per step, launch to wait (CUDA events; overlapped time included)",
    "launch": "launch seconds per step (NCCL: transfers overlap, see a CUDA trace)",
}


def comm_figure(comm: pd.DataFrame, theory_elements: float | None, *, rank: int, stage: int,
                timing: str | None = None, world_size: int | None = None) -> go.Figure:
    """Per step of ``rank``: elements (stacked by collective kind) against the paper's volume for the
    run's accumulation (2Ψ for stages 0-2, 3Ψ for stage 3 at one reduction per step), and seconds per
    collective kind: host wall time, device time between CUDA events when ``timing`` is "cuda_event", or
    launch time in profiles older than issue 19 whose ``timing`` is "launch"."""
    mine = comm[comm["rank"] == rank] if not comm.empty else comm
    if mine.empty:
        why = ("a data-parallel world of one rank moves nothing (the paper's volume is 0, not 2Ψ or 3Ψ), so its "
               "step records count no collective" if world_size == 1 else "it recorded no collective in its step "
               "records")
        return _empty(f"Rank {rank}: {why}.", title=f"Communication per step, rank {rank}, stage {stage}")
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.08,
                        subplot_titles=["elements per step (the paper's logical volume)",
                                        _COMM_SECONDS_TITLE.get(timing, "wall seconds per step")])
    kinds = sorted(mine["kind"].unique())
    for index, kind in enumerate(kinds):
        rows = mine[mine["kind"] == kind]
        color = _PALETTE[index % len(_PALETTE)]
        inter = rows["inter_node_bytes"] if "inter_node_bytes" in rows else rows["bytes"] * np.nan
        custom = np.stack([rows["calls"], rows["bytes"], inter], axis=-1)
        fig.add_bar(x=rows["step"], y=rows["elements"], name=kind, legendgroup=kind, marker_color=color,
                    customdata=custom, row=1, col=1,
                    hovertemplate=f"{kind}, step %{{x}}<br>%{{y:,.0f}} elements in %{{customdata[0]}} calls"
                                  "<br>%{customdata[1]:,.0f} bytes, %{customdata[2]:,.0f} between nodes"
                                  "<extra></extra>")
        fig.add_bar(x=rows["step"], y=rows["seconds"], name=kind, legendgroup=kind, marker_color=color,
                    showlegend=False, row=2, col=1,
                    hovertemplate=f"{kind}, step %{{x}}<br>%{{y:.4f}} s<extra></extra>")
    title = f"Communication per step, rank {rank}, stage {stage}"
    if "inter_node_bytes" in mine and mine["inter_node_bytes"].notna().any():  # issue 22: the node split
        title += f" ({mine.groupby('step')['inter_node_bytes'].sum().mean():,.0f} bytes between nodes per step)"
    if theory_elements is not None:
        label = f"theory = {theory_elements:,.0f} elements"
        fig.add_hline(y=theory_elements, line_dash="dash", line_color="black", annotation_text=label,
                      annotation_position="top left", row=1, col=1)
        measured = mine.groupby("step")["elements"].sum().mean()
        title += f": measured / theory = {measured / theory_elements:.3f}"
    fig.update_layout(barmode="stack", height=620, title=title, legend_title="collective")
    fig.update_yaxes(title_text="elements", tickformat="~s", row=1, col=1)
    fig.update_yaxes(title_text="seconds", row=2, col=1)
    fig.update_xaxes(title_text="step", row=2, col=1)
    return fig


# --------------------------------------------------------------------------------------------------
# Comparing runs, and the estimator
# --------------------------------------------------------------------------------------------------


def comparison_table(runs: Sequence[LoadedRun]) -> pd.DataFrame:
    """One row per loaded run: stage, N_d, Ψ, measured peak model states (max over ranks), formula,
    ratio, peak allocated and RSS, comm elements per step (rank max) and theory, median step seconds."""
    rows = []
    for loaded in sorted((r for r in runs if r.run is not None), key=lambda r: (r.run.stage, r.label)):
        if loaded.run is None or loaded.summary is None:
            continue
        ranks = loaded.summary["ranks"]

        def peak(values: Any) -> float:
            numbers = [v for v in values if isinstance(v, (int, float))]
            return max(numbers) if numbers else float("nan")

        prediction = loaded.summary["prediction"] or {}
        measured = peak(r["model_state_bytes"] for r in ranks)
        predicted = prediction.get("model_state_bytes")
        theory = comm_theory_elements(loaded.run)
        rows.append({
            "run": loaded.label, "stage": loaded.run.stage, "N_d": loaded.run.world_size,
            "params": loaded.summary["num_params"], "model_states": measured,
            "formula": predicted if predicted is not None else float("nan"),
            "ratio": measured / predicted if predicted else float("nan"),
            "peak_allocated": peak(r["allocator_peak"].get("allocated") for r in ranks),
            "peak_rss": peak(r["allocator_peak"].get("rss") for r in ranks),
            "comm_elements_per_step": peak(r["comm_elements_per_step"] for r in ranks),
            "comm_theory": theory if theory is not None else float("nan"),
            "step_seconds": peak(r["step_seconds"] for r in ranks),
        })
    return pd.DataFrame(rows)


def comparison_figure(table: pd.DataFrame) -> go.Figure:
    """Runs side by side: model states (measured vs formula), peak allocated and RSS, communication
    per step (measured vs theory), median step time."""
    if table.empty:
        return _empty("No loaded run to compare.")
    fig = make_subplots(rows=2, cols=2, vertical_spacing=0.2, horizontal_spacing=0.1, subplot_titles=[
        "model states per rank: measured vs formula", "peak allocated and RSS per rank",
        "communication per step: measured vs theory", "median step time"])
    x = table["run"]
    panels = [
        (1, 1, [("model_states", "measured model states"), ("formula", "formula")], "bytes"),
        (1, 2, [("peak_allocated", "peak allocated"), ("peak_rss", "peak RSS")], "bytes"),
        (2, 1, [("comm_elements_per_step", "measured elements"), ("comm_theory", "theory 2Ψ/3Ψ")], "elements"),
        (2, 2, [("step_seconds", "median step seconds")], "seconds"),
    ]
    colors = iter(_PALETTE)
    for row, col, series, unit in panels:
        for column, label in series:
            value = "%{y:,.0f} bytes (%{y:.3s}B)" if unit == "bytes" else "%{y:,.4g} " + unit
            fig.add_bar(x=x, y=table[column], name=label, marker_color=next(colors),
                        hovertemplate=f"%{{x}}<br>{label}: {value}<extra></extra>", row=row, col=col)
        fig.update_yaxes(**(_BYTES_AXIS if unit == "bytes" else {"title_text": unit}), row=row, col=col)
    fig.update_layout(barmode="group", height=760, title="Runs side by side")
    return fig


def estimator_figure(table: pd.DataFrame) -> go.Figure:
    """Per-device model-state GB against N_d (log-log), one line per (model, stage) of a Table 1 frame."""
    fig = go.Figure()
    dashes = ["solid", "dash", "dot", "dashdot"]
    for index, (model, stage) in enumerate(table.columns):
        stage_index = list(est.STAGE_NAMES.values()).index(stage)
        model_index = list(dict.fromkeys(m for m, _ in table.columns)).index(model)
        fig.add_scatter(x=table.index, y=table[(model, stage)], mode="lines+markers", name=f"{model} {stage}",
                        line={"dash": dashes[model_index % 4], "color": _PALETTE[stage_index]},
                        hovertemplate=f"{model}, {stage}<br>N_d=%{{x}}<br>%{{y:.4g}} GB per device<extra></extra>")
    fig.update_layout(title="Per-device model-state memory by data-parallel degree",
                      xaxis={"type": "log", "title": "N_d (data-parallel degree)"},
                      yaxis={"type": "log", "title": "GB per device (1e9 bytes)"})
    return fig


def _empty(message: str, title: str | None = None) -> go.Figure:
    fig = go.Figure()
    fig.add_annotation(text=message, showarrow=False, x=0.5, y=0.5, xref="paper", yref="paper")
    fig.update_layout(xaxis={"visible": False}, yaxis={"visible": False}, height=200 if title is None else 260)
    if title is not None:
        fig.update_layout(title=title)
    return fig


def plan_figure(result: dict[str, Any], *, top: int = 15) -> go.Figure:
    """``hfzero plan``'s configurations: estimated tokens/s against per-rank peak, those that fit in color
    by ZeRO stage, the others gray, the budget as a vertical line, the first ``top`` that fit labelled."""
    fig = go.Figure()
    rows = result["configurations"]
    for stage in est.STAGES:
        mine = [r for r in rows if r["fits"] and r["config"]["stage"] == stage]
        if mine:
            fig.add_scatter(x=[r["peak_bytes"] for r in mine], y=[r["tokens_per_s"] for r in mine], mode="markers",
                            name=f"stage {stage} ({est.STAGE_NAMES[stage]})", text=[r["label"] for r in mine],
                            marker={"color": _PALETTE[stage], "size": 9},
                            hovertemplate="%{text}<br>peak %{x:.3s}B<br>%{y:,.0f} tokens/s<extra></extra>")
    rejected = [r for r in rows if not r["fits"]]
    if rejected:
        fig.add_scatter(x=[r["peak_bytes"] for r in rejected], y=[r["tokens_per_s"] for r in rejected], mode="markers",
                        name="does not fit", text=[f"{r['label']}<br>{r['reason']}" for r in rejected],
                        marker={"color": "lightgray", "size": 7},
                        hovertemplate="%{text}<br>%{y:,.0f} tokens/s<extra></extra>")
    fig.add_vline(x=result["budget_bytes"], line_dash="dash", line_color="gray",
                  annotation_text="budget per rank", annotation_position="top right")
    fig.update_layout(title=f"Plan: configurations by estimated throughput and per-rank peak, "
                            f"{result['devices']} devices", height=480, xaxis_title="per-rank peak (bytes)",
                      yaxis_title="tokens / s (estimated)", legend={"title": "fits, by ZeRO stage"})
    fig.update_xaxes(**_BYTES_AXIS, automargin=True)
    fig.update_yaxes(automargin=True)
    return fig
