"""Streamlit views: each one wires ``dashboard.data`` tables into ``dashboard.figures`` figures.

Nothing here computes a figure of its own; the app (``dashboard/app.py``) calls ``main``.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path

import streamlit as st

from dashboard import data, estimator, figures
from dashboard import pipeline as pipeline_view
from dashboard.data import LoadedRun
from hfzero.planning import estimate as est
from hfzero.logging import get_logger

logger = get_logger(__name__)

RUNS_ENV = "HFZERO_DASHBOARD_RUNS"
"""Run directories (os.pathsep-separated) used when the app gets none on its command line."""

DEFAULT_MAX_POINTS = 2000
"""Points per rank and trace before the timeline is downsampled."""


def initial_paths(argv: list[str] | None = None) -> list[str]:
    """Run directories from ``--run`` arguments (``streamlit run app.py -- --run A B``), else from
    the ``HFZERO_DASHBOARD_RUNS`` environment variable."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--run", nargs="*", default=[])
    known, _ = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    if known.run:
        return list(known.run)
    return [p for p in os.environ.get(RUNS_ENV, "").split(os.pathsep) if p]


@st.cache_resource(max_entries=64, show_spinner="Loading profile...")
def _load_cached(path: str, signature: tuple[tuple[str, int, int], ...]) -> LoadedRun:
    """One loaded run per (path, file sizes and times): a growing run reloads on the next refresh."""
    return data.load(path)


def load_all(paths: list[Path]) -> list[LoadedRun]:
    """Every run directory, loaded (cached until one of its files changes)."""
    return [_load_cached(str(p), data.run_signature(p)) for p in paths]


# --------------------------------------------------------------------------------------------------
# Views
# --------------------------------------------------------------------------------------------------


def _show_run_notes(loaded: LoadedRun) -> bool:
    """Show the run's error or warnings; False when there is nothing to plot."""
    if loaded.error is not None:
        st.error(f"Cannot show this run: {loaded.error}")
        return False
    assert loaded.run is not None
    for warning in loaded.run.warnings:
        st.warning(warning)
    stopped = [log.rank for log in loaded.run.ranks.values() if not log.stopped]
    if stopped:
        st.info(f"Rank(s) {stopped} have no stop record: the run is still being written or crashed.")
    if not any(log.of_kind("step") or log.of_kind("phase") for log in loaded.run.ranks.values()):
        st.info("No step recorded yet.")
    return True


def view_memory(loaded: LoadedRun, settings: dict[str, int]) -> None:
    """Per-rank bytes by role beside the paper's formula."""
    figure = figures.memory_by_role_figure(loaded)
    st.plotly_chart(figure, width="stretch")
    st.markdown(figures.legend_html(figure), unsafe_allow_html=True)
    st.markdown(figures.peak_sentence(loaded))
    assert loaded.summary is not None
    rows = [{"rank": r["rank"], "measured model states (bytes)": r["model_state_bytes"],
             "formula (bytes)": r["predicted_model_state_bytes"], "measured / formula": r["ratio"],
             "steps": r["steps"], "stopped": r["stopped"], "truncated": r["truncated"]}
            for r in loaded.summary["ranks"]]
    st.dataframe(rows, hide_index=True)
    st.caption("The formula counts the unpadded trainable Ψ (and frozen parameters Ψ_f: whole at stages 0-2, "
               "/N_d at stage 3); the measurement includes bucket padding (at most N_d - 1 elements per bucket). "
               "Transient buffers, activations and the rest of the rank's peak are the chart's other bars, not "
               "model states.")
    groups = data.sp_group_rows(loaded.summary)
    if groups:
        st.dataframe(groups, hide_index=True)
        st.caption("Sequence parallelism (docs/sequence.md): the ranks grouped by their sp rank, the position of "
                   "the chunk of every sequence they hold, over the data-parallel replicas. Model states are "
                   "sharded over all dp x sp ranks, so they agree across groups; activations are the chunk's.")
    whole = figures.whole_peak_rows(loaded)
    if whole:
        st.dataframe(whole, hide_index=True)
        st.caption("The rank's whole peak (RSS on a CPU, reserved on CUDA; the step with the largest sampled "
                   "peak) = model states + transient + activations and checkpoints (measured by role) + other / "
                   "allocator overhead (the peak minus every role: untracked live tensors, allocator cache and "
                   "fragmentation, libraries). Activations measured at their peak beside the estimator's activation "
                   "model (decoder, encoder or encoder-decoder) from the header (see docs/zero-r.md); the estimate leaves out a checkpointed layer's "
                   "recomputation, which the saved-tensor measurement does not see either.")
    assert loaded.run is not None
    peaks = data.peak_frame(loaded.run)
    if not peaks.empty:
        rank = st.selectbox("Peak decomposition of rank", sorted(peaks["rank"].unique()), key="peak_rank")
        st.plotly_chart(figures.peak_decomposition_figure(peaks, rank), width="stretch")
        st.caption("Total = RSS (CPU) or reserved (CUDA) at the step's largest sampled phase boundary; "
                   "activations = the measured activation roles; other = allocated minus every role; "
                   "remainder = total minus allocated "
                   "(free but held by the allocator, and libraries). See docs/profile-format.md.")


def _pick_ranks(loaded: LoadedRun, key: str) -> list[int]:
    assert loaded.run is not None
    ranks = list(loaded.run.ranks)
    return st.multiselect("Ranks", ranks, default=ranks[:8], key=f"{key}_ranks")


def view_timeline(loaded: LoadedRun, settings: dict[str, int]) -> None:
    """Memory per rank over steps and phases."""
    assert loaded.run is not None
    ranks = _pick_ranks(loaded, "timeline")
    frame = data.timeline_frame(loaded.run)
    frame = frame[frame["rank"].isin(ranks)] if not frame.empty else frame
    frame, factor = data.downsample(frame, settings["max_points"])
    st.plotly_chart(figures.timeline_figure(frame, factor=factor), width="stretch")


def view_fragmentation(loaded: LoadedRun, settings: dict[str, int]) -> None:
    """Fragmentation ratio, largest free block, free vs in use, retries."""
    assert loaded.run is not None
    ranks = _pick_ranks(loaded, "fragmentation")
    timeline, factor = data.downsample(_only(data.timeline_frame(loaded.run), ranks), settings["max_points"])
    steps, _ = data.downsample(_only(data.step_frame(loaded.run), ranks), settings["max_points"])
    figure, notes = figures.fragmentation_figure(timeline, steps, factor=factor)
    st.plotly_chart(figure, width="stretch")
    for note in notes:
        st.caption(note)


def view_comm(loaded: LoadedRun, settings: dict[str, int]) -> None:
    """Communication volume and time per collective kind per step, against 2Ψ / 3Ψ."""
    assert loaded.run is not None
    rank = st.selectbox("Rank", list(loaded.run.ranks), key="comm_rank")
    comm = data.comm_frame(loaded.run)
    if not comm.empty:
        comm = comm[comm["rank"] == rank]
        steps = sorted(comm["step"].unique())
        if len(steps) > settings["max_points"]:
            stride = -(-len(steps) // settings["max_points"])
            comm = comm[comm["step"].isin(steps[::stride])]
            st.caption(f"Showing every {stride}th step of {len(steps)}.")
    st.plotly_chart(figures.comm_figure(comm, data.comm_theory_elements(loaded.run), rank=rank,
                                        stage=loaded.run.stage, timing=loaded.run.header.get("comm_timing"),
                                        world_size=loaded.run.world_size),
                    width="stretch")
    micro, policy = data.accumulation_of(loaded.run)
    st.caption("Elements follow the paper's logical volume: an all-reduce of n counts 2n, a reduce-scatter "
               "or an all-gather of n counts n. Theory: 2Ψ (stages 0-2) or 3Ψ (stage 3) per reduction, "
               f"here {micro} micro-batch(es) per step with '{policy}' accumulation ('sharded' reduces every "
               "micro-batch, 'local' once per step; stage 3 gathers for every micro-batch). Small extra "
               "all-reduces (gradient clipping, overflow checks) come on top.")


def view_pipeline(loaded: LoadedRun, settings: dict[str, int]) -> None:
    """Per pipeline stage: memory by role, the bubble and the communication beside the cost model; one
    step's schedule as busy spans per rank."""
    assert loaded.run is not None
    st.plotly_chart(pipeline_view.pipeline_figure(loaded.run), width="stretch")
    frame = pipeline_view.stage_frame(loaded.run)
    if frame.empty:
        return
    st.dataframe(frame, hide_index=True)
    st.caption("Bubble: per stage, the time the rank waited inside the schedule (receives, sends, scheduling) "
               "over the time it ran its own actions (forwards, loss, backwards, the end-of-step dp reduction), "
               "median over steps and the stage's ranks; (P-1)/(vM) is the cost model's. Host wall times: on a "
               "shared CPU machine contention inflates both. dp elements: the engine's collectives (the paper's "
               "volume convention); P2P: the activations and gradients the stage sent / received.")
    steps = pipeline_view.steps_with_spans(loaded.run)
    if steps:
        step = st.selectbox("Schedule of step", steps, index=len(steps) - 1, key="pipeline_step")
        st.plotly_chart(pipeline_view.schedule_figure(loaded.run, step), width="stretch")


def view_compare(runs: list[LoadedRun], settings: dict[str, int]) -> None:
    """Several runs side by side."""
    good = [r for r in runs if r.run is not None]
    labels = {r.label: r for r in good}
    chosen = st.multiselect("Runs to compare", list(labels), default=list(labels)[:8], key="compare_runs")
    table = figures.comparison_table([labels[c] for c in chosen])
    st.plotly_chart(figures.comparison_figure(table), width="stretch")
    if not table.empty:
        st.dataframe(table, hide_index=True)


def view_estimator(settings: dict[str, int]) -> None:
    """The paper's Table 1 for chosen Ψ, N_d and dtypes, and the largest model that fits."""
    left, right = st.columns(2)
    with left:
        source = st.radio("Model size", ["Ψ (parameters)", "Hugging Face config path"], key="est_source",
                          horizontal=True)
        if source == "Ψ (parameters)":
            raw = st.text_input("Ψ, e.g. 7.5e9", "7.5e9", key="est_params")
        else:
            raw = st.text_input("config.json or model directory (local)", "", key="est_config")
        frozen_raw = st.text_input("frozen parameters Ψ_f (e.g. a LoRA base model; parameter bytes only)", "0",
                                   key="est_frozen")
        dps_text = st.text_input("N_d values", ", ".join(map(str, estimator.PAPER_DPS)), key="est_dps")
        paper = st.checkbox("add the paper's 7.5B, 128B and 1T columns", value=False, key="est_paper")
    with right:
        dtype = st.selectbox("parameter / gradient dtype", ["bf16", "fp16", "fp32"], key="est_dtype")
        optimizer = st.selectbox("optimizer", ["adam", "adamw", "sgd_momentum", "sgd"], key="est_optimizer")
        offload = st.checkbox("ZeRO-Offload (device bytes only: optimizer states, and gradients from stage 2, on the host)",
                              key="est_offload")
        stage = st.selectbox("stage", list(est.STAGES), index=3, key="est_stage",
                             format_func=lambda s: f"{s} ({est.STAGE_NAMES[s]})")
        memory_gb = st.number_input("device memory (GB = 1e9 bytes)", min_value=0.1, value=32.0, key="est_memory")
    try:
        dps = estimator.parse_dps(dps_text)
        models = _estimator_models(source, raw)
        if paper:
            models.update({"7.5B": 7.5e9, "128B": 128e9, "1T": 1e12})
        if not models:
            st.info("Enter Ψ or a config path.")
            return
        precision = est.precision_bytes(dtype, optimizer)
        frozen = estimator.parse_count(frozen_raw, "frozen parameters")
        table = estimator.model_states_table(models, dps, dtype=dtype, optimizer=optimizer, offload_optimizer=offload,
                                             frozen_params=frozen)
        fits = estimator.max_params_table(memory_gb * estimator.GB, dps, dtype=dtype, optimizer=optimizer,
                                          offload_optimizer=offload)
    except est.EstimateError as err:
        st.error(str(err))
        return
    st.caption(f"Bytes per parameter: p={precision.param_bytes}, g={precision.grad_bytes}, K={precision.optimizer_k}.")
    st.subheader("Per-device model-state memory (GB), the paper's Table 1 layout")
    st.table(table.style.format("{:.3g}"))
    st.plotly_chart(figures.estimator_figure(table), width="stretch")
    st.subheader(f"Largest model that fits {memory_gb:g} GB per device (parameters)")
    st.table(fits.style.format("{:.4g}").highlight_max(axis=None, subset=[est.STAGE_NAMES[stage]], color="#cde"))
    first = next(iter(models))
    need = table[(first, est.STAGE_NAMES[stage])]
    st.write(f"{first} at stage {stage}: " + ", ".join(f"N_d={dp}: {gb:.3g} GB" for dp, gb in need.items()))


def view_plan(settings: dict[str, int]) -> None:
    """``hfzero plan`` interactively: every configuration's per-rank peak and estimated step time, the
    ones that fit ranked by throughput, the reason each other one does not (see docs/plan.md)."""
    from hfzero.planning import plan as planner

    left, middle, right = st.columns(3)
    with left:
        source = st.radio("Model", ["Ψ (parameters)", "Hugging Face config path"], key="plan_source", horizontal=True)
        raw = st.text_input("Ψ, e.g. 7.5e9" if source == "Ψ (parameters)" else "config.json or model directory",
                            "7.5e9" if source == "Ψ (parameters)" else "", key=f"plan_model_{source[0]}")
        seq_len = st.number_input("sequence length", min_value=1, value=1024, key="plan_seq")
        batch = st.number_input("global batch (sequences per step)", min_value=1, value=64, key="plan_batch")
        dtype = st.selectbox("dtype", ["bf16", "fp16", "fp32"], key="plan_dtype")
    with middle:
        per_node = st.number_input("devices per node", min_value=1, value=8, key="plan_per_node")
        nodes = st.number_input("nodes", min_value=1, value=8, key="plan_nodes")
        memory_gb = st.number_input("memory per device (GB = 1e9 bytes)", min_value=0.1, value=32.0, key="plan_mem")
        tflops = st.number_input("sustained TFLOP/s per device", min_value=0.001, value=planner.DEFAULT_GPU_TFLOPS,
                                 key="plan_tflops")
    with right:
        links = list(planner.LINK_BYTES_PER_S)
        intra = st.selectbox("link inside a node", links, index=links.index("nvlink"), key="plan_intra")
        inter = st.selectbox("link between nodes", links, index=links.index("ib"), key="plan_inter")
        headroom = st.slider("headroom (fraction kept free)", 0.0, 0.5, est.DEFAULT_HEADROOM, 0.05, key="plan_headroom")
        top = st.number_input("configurations shown", min_value=1, value=15, key="plan_top")
    try:
        hardware = planner.Hardware(devices_per_node=int(per_node), nodes=int(nodes), memory_bytes=memory_gb * 1e9,
                                    flops=tflops * 1e12, intra_bytes_per_s=planner.LINK_BYTES_PER_S[intra],
                                    inter_bytes_per_s=planner.LINK_BYTES_PER_S[inter])
        if not raw.strip():
            st.info("Enter Ψ or a config path.")
            return
        if source == "Ψ (parameters)":
            params = next(iter(_estimator_models(source, raw).values()))
            work = planner.Workload(params=params, seq_len=int(seq_len), global_batch=int(batch), dtype=dtype)
        else:
            work = planner.workload_from_config(raw.strip(), seq_len=int(seq_len), global_batch=int(batch), dtype=dtype)
        rows = planner.plan(work, hardware, headroom=headroom)
    except est.EstimateError as err:
        st.error(str(err))
        return
    result = planner.summary(rows, work, hardware, headroom=headroom)
    st.plotly_chart(figures.plan_figure(result, top=int(top)), width="stretch")
    best = result["best"]
    st.markdown(f"**Choice:** {best['label']}: {best['peak_bytes'] / 1e9:.2f} GB per rank, about "
                f"{best['step_s']:.3g} s per step ({best['tokens_per_s']:,.0f} tokens/s, estimated)" if best
                else "**No configuration fits**; the reasons are below.")
    st.subheader(f"Model states per device at N_d = {hardware.devices} (the paper's formula)")
    st.dataframe([{"stage": f"{r['stage']} ({r['name']})", "GB": r["model_states_bytes"] / 1e9,
                   f"fits {memory_gb:g} GB": r["fits"]} for r in result["stages"]], hide_index=True)
    configurations = result["configurations"]
    st.subheader("Configurations that fit, fastest first")
    st.dataframe([_plan_row(r) for r in configurations if r["fits"]][:int(top)], hide_index=True)
    st.subheader("Configurations that do not fit")
    st.dataframe([{"configuration": r["label"], "why not": r["reason"]} for r in configurations if not r["fits"]],
                 hide_index=True)
    st.caption("Step time = compute (6ΨT + attention FLOPs over the devices, x 4/3 with checkpointing, x (1 + "
               "bubble) with pp) + data-parallel, tensor-parallel, pipeline and offload traffic over their links, "
               "nothing overlapped. See [Note: plan cost model] in hfzero/planning/plan.py.")


def _plan_row(row: dict[str, object]) -> dict[str, object]:
    memory = row["memory"]
    return {"configuration": row["label"], "peak GB": memory["total"] / 1e9, "model states GB": memory["model_states"] / 1e9,
            "transient GB": memory["transient"] / 1e9, "activations GB": memory["activations"] / 1e9,
            "step s (est.)": row["step_s"], "tokens/s (est.)": row["tokens_per_s"]}


def _estimator_models(source: str, raw: str) -> dict[str, float]:
    raw = raw.strip()
    if not raw:
        return {}
    if source == "Ψ (parameters)":
        try:
            value = float(raw)
        except ValueError:
            raise est.EstimateError(f"Ψ must be a number of parameters such as 7.5e9, got {raw!r}") from None
        if not value > 0:
            raise est.EstimateError(f"Ψ must be positive, got {raw!r}")
        return {f"Ψ={value:.3g}": value}
    psi = float(est.params_from_config(raw))
    return {f"{Path(raw).name} (Ψ={psi:.3g})": psi}


def _only(frame: "data.pd.DataFrame", ranks: list[int]) -> "data.pd.DataFrame":
    return frame[frame["rank"].isin(ranks)] if not frame.empty else frame


# --------------------------------------------------------------------------------------------------
# The app
# --------------------------------------------------------------------------------------------------

RUN_VIEWS: dict[str, Callable[[LoadedRun, dict[str, int]], None]] = {
    "Memory by role": view_memory,
    "Timeline": view_timeline,
    "Fragmentation": view_fragmentation,
    "Communication": view_comm,
    "Pipeline stages": view_pipeline,
}
"""Views of one run."""

VIEWS: tuple[str, ...] = (*RUN_VIEWS, "Compare runs", "Estimator", "Planner")
"""Every view, in the sidebar's order."""


def _sidebar(paths: list[str]) -> tuple[str, list[Path], dict[str, int], int | None]:
    sidebar = st.sidebar
    sidebar.title("hfzero dashboard")
    view = sidebar.radio("View", VIEWS, key="view")
    extra = sidebar.text_input("Add a run directory or a parent of runs", key="extra_path")
    run_dirs, problems = data.resolve_paths(paths + ([extra] if extra.strip() else []))
    for problem in problems:
        sidebar.error(problem)
    if sidebar.button("Reload runs", key="reload"):
        _load_cached.clear()
    auto = sidebar.toggle("Auto-refresh (run still being written)", key="auto")
    every = sidebar.number_input("every (seconds)", min_value=1, value=5, key="every") if auto else None
    max_points = sidebar.number_input("Max points per rank before downsampling", min_value=100,
                                      value=DEFAULT_MAX_POINTS, step=100, key="max_points")
    return view, run_dirs, {"max_points": int(max_points)}, every


def _guarded(what: str, show: Callable[[], None]) -> None:
    """Run one view; a failure becomes one error line for it, never a traceback over the whole app."""
    try:
        show()
    except Exception as err:  # noqa: BLE001 - one malformed run must not take the other views down
        logger.warning("view of %s failed: %r", what, err)
        st.error(f"Cannot show {what}: {type(err).__name__}: {err}")


def main() -> None:
    """The whole app: sidebar (views, runs, refresh) and the chosen view."""
    st.set_page_config(page_title="hfzero dashboard", layout="wide")
    view, run_dirs, settings, every = _sidebar(initial_paths())

    @st.fragment(run_every=every)
    def body() -> None:
        runs = load_all(run_dirs)
        for bad in (r for r in runs if r.error is not None):
            st.error(f"{bad.path.name}: {bad.error}")
        if view == "Estimator":
            view_estimator(settings)
        elif view == "Planner":
            view_plan(settings)
        elif not runs:
            st.info("No run directory given. Start with `hfzero dashboard RUN_DIR`, or add one in the sidebar.")
        elif view == "Compare runs":
            _guarded("the comparison", lambda: view_compare(runs, settings))
        else:
            labels = [r.label for r in runs]
            index = st.selectbox("Run", range(len(runs)), format_func=lambda i: labels[i], key="run_index")
            loaded = runs[index]
            st.caption(str(loaded.path))
            if _show_run_notes(loaded):
                _guarded(str(loaded.path), lambda: RUN_VIEWS[view](loaded, settings))

    body()
