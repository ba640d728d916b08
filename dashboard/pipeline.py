"""The pipeline view's tables and figures: per pipeline stage, memory by role, the bubble and the
communication, each beside the cost model; and one step's schedule as a timeline of busy spans.

Built from ``hfzero.profiler.stages.stage_table`` (pure Python) and the step records' ``pipeline``
objects (docs/profile-format.md); no Streamlit here, no torch.
"""

from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from hfzero.profiler.reader import Run
from hfzero.profiler.stages import pp_rank_of, stage_table
from hfzero.roles import MODEL_STATE_ROLES, MemoryRole

MEASURED = "measured"
COST_MODEL = "cost model"
ACTION_COLORS = {"forward": "#1f77b4", "loss": "#9467bd", "backward": "#ff7f0e", "backward_weight": "#d62728",
                 "reduce": "#2ca02c"}
"""One color per timed stage action (see [Note: measuring the bubble])."""

_STATE_ROLES = [role.value for role in MemoryRole if role in MODEL_STATE_ROLES or role is MemoryRole.PARAM_GATHERED]
"""Roles the cost model predicts per stage (stage-3 "step" gathering holds param_gathered for the step)."""
_BYTES_AXIS = {"tickformat": "~s", "ticksuffix": "B"}


def stage_frame(run: Run) -> pd.DataFrame:
    """One row per pp rank: stages, ranks, model-state bytes measured and predicted, the bubble measured
    (idle / busy, median) beside (P - 1)/(vM), idle / wall, dp elements and P2P bytes per step measured and
    predicted. Empty for a run without pipeline parallelism."""
    rows = []
    for row in stage_table(run) or []:
        predicted_comm = row["predicted_comm_elements_per_step"]
        p2p, p2p_estimate = row["p2p_bytes_per_step"] or {}, row["p2p_estimate"] or {}
        rows.append({
            "pp rank": row["pp_rank"], "stages": ", ".join(map(str, row["stages"] or [])),
            "ranks": ", ".join(map(str, row["ranks"])), "steps": row["steps"],
            "model states (B)": row["model_state_bytes"], "cost model (B)": row["predicted_model_state_bytes"],
            "bubble idle/busy": row["bubble_fraction"], "(P-1)/(vM)": row["bubble_estimate"],
            "idle/wall": row["idle_fraction"], "step wall (s)": row["wall_seconds"],
            "dp elements/step": sum(row["comm_elements_per_step"].values()),
            "dp cost model": sum(predicted_comm.values()) if predicted_comm else None,
            "P2P sent (B)/step": p2p.get("send"), "P2P received (B)/step": p2p.get("recv"),
            "P2P cost model (B)": p2p_estimate.get("send"),
        })
    return pd.DataFrame(rows)


def pipeline_figure(run: Run) -> go.Figure:
    """Four panels by pp rank: model states by role (measured beside the cost model), the bubble (measured
    idle / busy beside (P - 1)/(vM)), the dp collectives' elements per step (measured beside the cost
    model) and the P2P bytes per step (sent, received, cost model)."""
    table = stage_table(run)
    if not table:
        return _empty("Pipeline stages: not a pipeline-parallel run (no pipeline section in its header)")
    labels = [f"pp {row['pp_rank']}" for row in table]
    fig = make_subplots(rows=2, cols=2, vertical_spacing=0.16, horizontal_spacing=0.1, subplot_titles=(
        "model states by role per stage", "bubble: idle / busy per stage", "dp collectives: elements per step",
        "P2P per step"))
    pair_x = [[label for label in labels for _ in (0, 1)], [kind for _ in labels for kind in (MEASURED, COST_MODEL)]]
    roles = [r for r in _STATE_ROLES if any(r in (row["roles_peak"] or {}) or r in (row["predicted_roles"] or {})
                                            for row in table)]
    for role in roles:
        y = [value for row in table for value in ((row["roles_peak"] or {}).get(role, 0),
                                                  (row["predicted_roles"] or {}).get(role, 0))]
        fig.add_bar(x=pair_x, y=y, name=role, legendgroup="roles", legendgrouptitle_text="model states",
                    hovertemplate=f"{role}<br>%{{x}}<br>%{{y:,.0f}} B<extra></extra>", row=1, col=1)
    fig.add_bar(x=labels, y=[row["bubble_fraction"] for row in table], name="measured idle / busy (median)",
                legendgroup="bubble", legendgrouptitle_text="bubble", marker_color="#d62728",
                customdata=[[row["idle_fraction"], row["idle_seconds"], row["busy_seconds"]] for row in table],
                hovertemplate="%{x}: idle/busy %{y:.3f}<br>idle/wall %{customdata[0]:.3f}<br>idle %{customdata[1]:.4f}"
                              " s, busy %{customdata[2]:.4f} s<extra></extra>", row=1, col=2)
    fig.add_scatter(x=labels, y=[row["bubble_estimate"] for row in table], mode="markers+lines",
                    name="(P - 1)/(vM)", legendgroup="bubble", marker={"symbol": "line-ew-open", "size": 30},
                    line={"dash": "dash", "color": "black"}, row=1, col=2)
    kinds = sorted({k for row in table for k in list(row["comm_elements_per_step"])
                    + list(row["predicted_comm_elements_per_step"] or {})})
    for kind in kinds:
        y = [value for row in table for value in (row["comm_elements_per_step"].get(kind, 0),
                                                  (row["predicted_comm_elements_per_step"] or {}).get(kind, 0))]
        fig.add_bar(x=pair_x, y=y, name=kind, legendgroup="comm", legendgrouptitle_text="dp collectives",
                    hovertemplate=f"{kind}<br>%{{x}}<br>%{{y:,.0f}} elements<extra></extra>", row=2, col=1)
    ways = (("sent", "p2p_bytes_per_step", "send", "#17becf"), ("received", "p2p_bytes_per_step", "recv", "#bcbd22"),
            ("cost model", "p2p_estimate", "send", "lightgray"))
    for name, key, way, color in ways:
        fig.add_bar(x=[labels, [name] * len(labels)], y=[(row[key] or {}).get(way) for row in table],
                    name=f"P2P {name}", legendgroup="p2p", legendgrouptitle_text="P2P", marker_color=color,
                    hovertemplate=f"P2P {name}<br>%{{x}}<br>%{{y:,.0f}} B per step<extra></extra>", row=2, col=2)
    header = run.header.get("pipeline") or {}
    fig.update_layout(barmode="stack", height=760, hovermode="closest",
                      title=f"Pipeline stages: pp={header.get('pp')} x dp={header.get('dp')}, "
                            f"{header.get('schedule')}, {header.get('n_micro')} micro-batches, ZeRO stage "
                            f"{header.get('zero_stage')} ({header.get('accumulation')})<br><sup>each stage's "
                            "measured figures beside the cost model; bubble = idle / busy time in the schedule "
                            "(see docs/profile-format.md)</sup>",
                      legend={"groupclick": "toggleitem"})
    fig.update_yaxes(**_BYTES_AXIS, row=1, col=1)
    fig.update_yaxes(**_BYTES_AXIS, row=2, col=2)
    return fig


def steps_with_spans(run: Run) -> list[int]:
    """Steps whose records carry schedule spans on at least one rank."""
    return sorted({s["step"] for log in run.ranks.values() for s in log.of_kind("step")
                   if isinstance(s.get("pipeline"), dict) and s["pipeline"].get("spans")})


def schedule_figure(run: Run, step: int) -> go.Figure:
    """One step's schedule: per rank (labelled by pp and dp rank), its timed actions as horizontal bars on
    the seconds since its window opened; the gaps are the stage's idle time (its share of the bubble).
    Windows of different ranks open at slightly different host times; they are aligned at 0."""
    fig = go.Figure()
    seen: set[str] = set()
    for rank, log in sorted(run.ranks.items()):
        record = next((s for s in log.of_kind("step") if s["step"] == step), None)
        figures = (record or {}).get("pipeline") or {}
        label = f"rank {rank} (pp {pp_rank_of(log.records)}, dp {(log.start or {}).get('dp_rank')})"
        for action, stage, micro, start, end in figures.get("spans") or []:
            fig.add_bar(y=[label], x=[end - start], base=[start], orientation="h", name=action,
                        marker_color=ACTION_COLORS.get(action, "gray"), legendgroup=action,
                        showlegend=action not in seen,
                        hovertemplate=f"{action} stage {stage} micro {micro}<br>%{{base:.4f}} s + %{{x:.4f}} s"
                                      "<extra></extra>")
            seen.add(action)
        if figures.get("wall_seconds") is not None:
            fig.add_scatter(y=[label], x=[figures["wall_seconds"]], mode="markers", name="end of the window",
                            marker={"symbol": "line-ns-open", "size": 18, "color": "black"},
                            legendgroup="window", showlegend="window" not in seen)
            seen.add("window")
    if not fig.data:
        return _empty(f"Schedule of step {step}: no spans recorded")
    fig.update_layout(barmode="overlay", height=140 + 40 * len(run.ranks), xaxis_title="seconds since the step's "
                      "schedule started (this rank)", yaxis={"autorange": "reversed"},
                      title=f"Schedule of step {step}: busy spans per rank; gaps are idle (the bubble)")
    return fig


def _empty(message: str) -> go.Figure:
    fig = go.Figure()
    fig.add_annotation(text=message, showarrow=False, x=0.5, y=0.5, xref="paper", yref="paper")
    fig.update_layout(xaxis={"visible": False}, yaxis={"visible": False}, height=200, title=message)
    return fig

