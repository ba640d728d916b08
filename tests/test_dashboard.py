"""The dashboard's loading, figures, estimator tables, CLI and Streamlit pages.

Synthetic profiles are written here following docs/profile-format.md, with exact figures: Ψ = 1000
parameters, bf16 + Adam (p = g = 2, K = 12), so every plotted number has a closed-form value. A real
2-rank gloo profile (stage 2 and 3, ``hfzero.prepare`` + ``ZeroProfiler``) runs every page once more.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dashboard import data, estimator, figures
from hfzero.planning import estimate as est
from hfzero.cli import main as cli_main
from hfzero.cli.dashboard import build_command, build_parser_for_tests
from hfzero.roles import MemoryRole

PSI = 1000
PHASE_EDGES = [("forward", "begin"), ("forward", "end"), ("backward", "begin"), ("backward", "end"),
               ("step", "begin"), ("step", "end")]
COMM_BY_STAGE = {0: {"all_reduce": 2 * PSI}, 1: {"reduce_scatter": PSI, "all_gather": PSI},
                 2: {"reduce_scatter": PSI, "all_gather": PSI}, 3: {"all_gather": 2 * PSI, "reduce_scatter": PSI}}


def model_state_roles(stage: int, world_size: int) -> dict[str, int]:
    """The engine's model-state bytes for Ψ = PSI, bf16 + Adam, by role."""
    n = world_size
    roles = {"param_shard": 2 * PSI // n} if stage == 3 else {"param_full": 2 * PSI}
    roles.update({"grad_shard": 2 * PSI // n} if stage >= 2 else {"grad_full": 2 * PSI})
    shard = n if stage >= 1 else 1
    roles.update(master_shard=4 * PSI // shard, optim_state=8 * PSI // shard)
    return roles


def allocated_at(rank: int, step: int, index: int) -> int:
    """The synthetic allocator's allocated bytes at a step's index-th phase record."""
    return 1_000_000 + 10_000 * rank + 100 * step + index


def write_run(path: Path, *, stage: int = 2, world_size: int = 2, steps: int = 3, run_id: str = "run-1",
              cut_last_line_of: int | None = None, ranks: list[int] | None = None, sp: int = 1) -> Path:
    """A complete synthetic run directory; ``cut_last_line_of`` leaves that rank's last line cut off
    (a crash mid-write, no stop record); ``ranks`` writes only those rank files."""
    path.mkdir(parents=True, exist_ok=True)
    inputs = {"num_params": PSI, "dp": world_size, "stage": stage, "param_bytes": 2, "grad_bytes": 2,
              "optimizer_k": 12, "persistent_params": 0}
    header = {
        "format_version": 1, "run_id": run_id, "start_time": "2025-01-01T00:00:00+00:00", "start_unix": 1.7e9,
        "world_size": world_size, "global_world_size": world_size, "stage": stage, "config": {"stage": stage},
        "model": {"class": "Tiny", "module": "tests", "num_params": PSI, "num_params_padded": PSI},
        "dtypes": {"param": "bf16", "grad": "bf16", "master": "fp32"}, "optimizer_class": "ZeroOptimizer",
        "device_type": "cpu", "versions": {}, "host": {}, "profiler": {"every_n_steps": 1, "cuda_snapshot": False},
        "prediction": {"model_state_bytes": est.model_states_bytes(PSI, world_size, stage), "formula": "f",
                       "optimizer": "adam", "inputs": inputs, "device_model_state_bytes": None},
    }
    (path / "header.json").write_text(json.dumps(header))
    for rank in ranks if ranks is not None else range(world_size):
        records = _rank_records(rank, stage, world_size, steps, run_id)
        if sp > 1:  # sequence parallelism: every record carries the sp coordinate, dp_rank is the replica
            for record in records:
                record.update(dp_rank=rank // sp, sp_rank=rank % sp)
                if record["kind"] == "step":
                    record["comm"] = {**record["comm"], "all_to_all": {"calls": 4, "elements": 100 * (rank % sp + 1),
                                                                       "bytes": 200 * (rank % sp + 1), "seconds": 0.01}}
        lines = [json.dumps(r) for r in records]
        text = "\n".join(lines) + "\n"
        if rank == cut_last_line_of:
            text = "\n".join(lines[:-1]) + "\n" + lines[-1][: len(lines[-1]) // 2]
        (path / f"rank-{rank}.jsonl").write_text(text)
    return path


def _allocator(allocated: int) -> dict[str, Any]:
    return {"device": "cpu", "rss": 3 * allocated, "allocated": allocated, "reserved": allocated + 5000,
            "heap_arena": allocated, "heap_in_use": allocated - 200, "heap_free": 200, "heap_mmapped": 0,
            "heap_keepcost": 0, "fragmentation": 200 / allocated}


def _rank_records(rank: int, stage: int, world_size: int, steps: int, run_id: str) -> list[dict[str, Any]]:
    states = model_state_roles(stage, world_size)
    base = {"roles": states, "model_state_bytes": sum(states.values()), "comm": {}}
    records = [{"kind": "event", "step": 0, "phase": None, "t": 0.0, "event": "start", "format_version": 1,
                "run_id": run_id, "rank": rank, "global_world_size": world_size, "dp_rank": rank,
                "world_size": world_size, "device": "cpu", "unix_time": 1.7e9, "every_n_steps": 1,
                **base, "allocator": _allocator(allocated_at(rank, 0, 0))}]
    comm = {kind: {"calls": 1, "elements": n, "bytes": 2 * n, "seconds": 0.01} for kind, n in COMM_BY_STAGE[stage].items()}
    for step in range(steps):
        for index, (phase, edge) in enumerate(PHASE_EDGES):
            roles = dict(states)
            if (phase, edge) == ("backward", "end"):
                roles["grad_bucket"] = 500  # transient: never a model state
            records.append({"kind": "phase", "step": step, "phase": phase, "t": step + index / 10, "edge": edge,
                            **({"micro": 1} if phase != "step" else {}), **base, "roles": roles,
                            "allocator": _allocator(allocated_at(rank, step, index)),
                            **({"seconds": 0.05} if edge == "end" else {})})
        records.append({"kind": "step", "step": step, "phase": None, "t": step + 0.5, "seconds": 0.3,
                        "phase_seconds": {"forward": 0.05, "backward": 0.05, "step": 0.05}, "micro_batches": 1,
                        **base, "roles": {**states, "grad_bucket": 500},
                        "allocator": _allocator(allocated_at(rank, step, 5)),
                        "allocator_max": _allocator(allocated_at(rank, step, 5)), "comm": comm})
    records.append({"kind": "event", "step": steps, "phase": None, "t": steps + 0.1, "event": "stop", **base,
                    "allocator": _allocator(allocated_at(rank, steps, 0))})
    return records


def decode(value: Any) -> np.ndarray:
    """A ``fig.to_dict()`` array: plotly 7 writes numeric arrays as {"dtype", "bdata" (base64)}."""
    if isinstance(value, dict) and "bdata" in value:
        return np.frombuffer(base64.b64decode(value["bdata"]), dtype=np.dtype(value["dtype"]))
    return np.asarray(value)


def trace(fig: Any, name: str, row_axis: str | None = None) -> Any:
    found = [t for t in fig.data if t.name == name and (row_axis is None or t.yaxis == row_axis)]
    assert len(found) == 1, [(t.name, t.yaxis) for t in fig.data]
    return found[0]


# --------------------------------------------------------------------------------------------------
# Loading and tables
# --------------------------------------------------------------------------------------------------


def test_tables_hold_every_record_with_exact_figures(tmp_path: Path) -> None:
    loaded = data.load(write_run(tmp_path / "run", stage=2, world_size=2, steps=3))
    assert loaded.error is None and loaded.label == "run (stage 2, N_d=2)"
    timeline = data.timeline_frame(loaded.run)
    assert len(timeline) == 2 * 3 * 6
    rank1 = timeline[timeline["rank"] == 1]
    assert list(rank1["x"][:7]) == pytest.approx([0, 1 / 6, 2 / 6, 3 / 6, 4 / 6, 5 / 6, 1])
    assert list(rank1["allocated"]) == [allocated_at(1, s, i) for s in range(3) for i in range(6)]
    assert set(timeline["model_state_bytes"]) == {2 * PSI + 14 * PSI / 2}
    assert list(rank1["transient_bytes"][:6]) == [0, 0, 0, 500, 0, 0]
    steps = data.step_frame(loaded.run)
    assert list(steps["seconds"]) == [0.3] * 6 and list(steps["max:allocated"][:3]) == [allocated_at(0, s, 5) for s in range(3)]
    comm = data.comm_frame(loaded.run)
    assert len(comm) == 2 * 3 * 2 and set(comm["elements"]) == {PSI}
    assert data.comm_theory_elements(loaded.run) == 2 * PSI


def test_peak_roles_add_up_to_the_measured_model_states(tmp_path: Path) -> None:
    loaded = data.load(write_run(tmp_path / "run", stage=1, world_size=4))
    peaks = data.peak_roles(loaded.run)
    expected = {**model_state_roles(1, 4), "grad_bucket": 500}  # the tie goes to the record with a bucket
    assert peaks == {r: {k: float(v) for k, v in expected.items()} for r in range(4)}


def test_downsample_keeps_peaks_and_bounds_points() -> None:
    import pandas as pd

    frame = pd.DataFrame({"rank": [0] * 10 + [1] * 4, "step": list(range(10)) + list(range(4)),
                          "x": [float(i) for i in range(10)] + [0.0, 1, 2, 3],
                          "allocated": [1, 9, 2, 3, 4, 5, 6, 7, 8, 0] + [5, 6, 7, 8], "phase": ["f"] * 14})
    small, factor = data.downsample(frame, 4)
    assert factor == 3
    assert list(small[small["rank"] == 0]["allocated"]) == [9, 5, 8, 0]
    assert list(small[small["rank"] == 0]["step"]) == [0, 3, 6, 9]
    assert list(small[small["rank"] == 1]["allocated"]) == [7, 8]
    assert data.downsample(frame, 100) == (frame, 1)


def test_finding_runs_under_a_parent_and_bad_paths(tmp_path: Path) -> None:
    for stage in (0, 1):
        write_run(tmp_path / "parent" / "model" / f"stage{stage}", stage=stage)
    (tmp_path / "empty").mkdir()
    runs, problems = data.resolve_paths([tmp_path / "parent", tmp_path / "missing", tmp_path / "empty"])
    assert runs == [tmp_path / "parent" / "model" / "stage0", tmp_path / "parent" / "model" / "stage1"]
    assert len(problems) == 2 and "no such directory" in problems[0] and "holds no profile run" in problems[1]


# --------------------------------------------------------------------------------------------------
# Crashed, malformed and foreign runs
# --------------------------------------------------------------------------------------------------


def test_crashed_run_loads_and_plots_what_is_there(tmp_path: Path) -> None:
    path = write_run(tmp_path / "crash", world_size=4, steps=2, cut_last_line_of=1, ranks=[0, 1, 2])
    loaded = data.load(path)
    assert loaded.error is None
    assert any("last line cut off" in w for w in loaded.run.warnings)
    assert any("no rank file for rank(s) [3]" in w for w in loaded.run.warnings)
    assert not loaded.run.ranks[1].stopped and loaded.run.ranks[0].stopped
    fig = figures.memory_by_role_figure(loaded)
    assert len(trace(fig, "optim_state (model state)").y) == 3 * 3  # ranks 0-2: model states, formula, transient
    assert len(data.timeline_frame(loaded.run)) == 3 * 2 * 6


@pytest.mark.parametrize("damage, message", [
    (lambda p: (p / "rank-0.jsonl").write_text('{"kind": "event"\n{"kind": "phase"}\n'), "rank-0.jsonl:1: malformed JSON"),
    (lambda p: (p / "header.json").write_text(json.dumps({"hello": "world"})), "no format_version"),
    (lambda p: (p / "header.json").write_text(json.dumps({"format_version": 7, "run_id": "x", "world_size": 1,
                                                          "stage": 0})), "unknown format_version 7"),
    (lambda p: write_run(p, run_id="other-run", ranks=[1]) and None, "rank file of another run"),
    (lambda p: (p / "header.json").unlink(), "missing header.json"),
])
def test_malformed_and_foreign_files_are_named(tmp_path: Path, damage: Any, message: str) -> None:
    path = write_run(tmp_path / "run")
    if message == "rank file of another run":
        other = write_run(tmp_path / "other", run_id="other-run")
        (path / "rank-1.jsonl").write_bytes((other / "rank-1.jsonl").read_bytes())
    else:
        damage(path)
    loaded = data.load(path)
    assert loaded.run is None and message in loaded.error, loaded.error


def test_large_profile_is_downsampled_for_plotting(tmp_path: Path) -> None:
    loaded = data.load(write_run(tmp_path / "big", world_size=8, steps=700))
    timeline = data.timeline_frame(loaded.run)
    assert len(timeline) == 8 * 700 * 6
    small, factor = data.downsample(timeline, 2000)
    assert factor == 3
    fig = figures.timeline_figure(small, factor=factor)
    allocated = [t for t in fig.data if t.yaxis == "y"]
    assert len(allocated) == 8 and all(len(t.y) <= 2000 for t in allocated)
    assert max(trace(fig, "rank 7", "y").y) == allocated_at(7, 699, 5)  # the last peak survives
    assert "max over 3 records" in fig.layout.title.text


# --------------------------------------------------------------------------------------------------
# Figures
# --------------------------------------------------------------------------------------------------


def test_memory_by_role_figure_against_the_formula(tmp_path: Path) -> None:
    loaded = data.load(write_run(tmp_path / "run", stage=2, world_size=2))
    fig = figures.memory_by_role_figure(loaded)
    labels = {t.name for t in fig.data}
    assert {f"{r.value} (model state)" for r in (MemoryRole.PARAM_FULL, MemoryRole.GRAD_SHARD)} <= labels
    assert "grad_bucket" in labels
    # per rank, left to right: model states (measured), formula, transient; the rest of the peak on the right
    assert list(fig.data[0].x[1][:3]) == ["model states", "formula", "transient"]
    assert list(trace(fig, "optim_state (model state)").y) == [4 * PSI, 0, 0] * 2
    assert list(trace(fig, "formula: optimizer states KΨ").y) == [0, 6 * PSI, 0] * 2
    assert list(trace(fig, "formula: parameters pΨ").y) == [0, 2 * PSI, 0] * 2
    assert list(trace(fig, "formula: gradients gΨ").y) == [0, PSI, 0] * 2
    bucket = trace(fig, "grad_bucket")
    assert [y for y, (_, kind) in zip(bucket.y, zip(*bucket.x)) if y] and all(
        kind == "transient" for y, (_, kind) in zip(bucket.y, zip(*bucket.x)) if y)  # never on the model-state bar
    ratio = trace(fig, "model states: measured / formula")
    assert list(ratio.text) == ["1.000"] * 2 and set(ratio.x[1]) == {"formula"}
    as_dict = fig.to_dict()["data"]
    grad_shard = next(t for t in as_dict if t["name"] == "grad_shard (model state)")
    assert list(decode(grad_shard["y"])) == [PSI, 0, 0] * 2
    # the legend: one entry per role, one per prediction, in three titled groups
    shown = [t for t in fig.data if t.showlegend is not False]
    assert {t.legendgrouptitle.text for t in shown if t.legendgrouptitle.text} == {
        "measured, by role", "predicted", "the rank's whole peak"}
    assert [t.name for t in shown if t.legendgroup == "formula"] == ["formula pΨ + gΨ + KΨ (hatched)"]


def test_timeline_and_fragmentation_figures(tmp_path: Path) -> None:
    loaded = data.load(write_run(tmp_path / "run", world_size=2, steps=2))
    timeline, steps = data.timeline_frame(loaded.run), data.step_frame(loaded.run)
    fig = figures.timeline_figure(timeline)
    titles = [a.text for a in fig.layout.annotations]
    assert titles == ["allocated", "reserved", "RSS (process resident)", "model states",
                      "transient roles (buckets, gathered, buffers)"]  # no checkpoints recorded: no panel
    assert list(trace(fig, "rank 1", "y").y) == [allocated_at(1, s, i) for s in range(2) for i in range(6)]
    assert list(trace(fig, "rank 0", "y3").y) == [3 * allocated_at(0, s, i) for s in range(2) for i in range(6)]
    assert "rank 1, step %{customdata[1]}" not in trace(fig, "rank 1", "y").hovertemplate  # rank is data
    assert trace(fig, "rank 1", "y").customdata[3][2] == "backward"
    frag, notes = figures.fragmentation_figure(timeline, steps)
    assert [a.text for a in frag.layout.annotations][0].startswith("fragmentation ratio")
    assert list(trace(frag, "rank 0", "y").y)[:2] == pytest.approx([200 / allocated_at(0, 0, i) for i in range(2)])
    assert set(trace(frag, "rank 0 free but held", "y2").y) == {5000}
    assert any("largest free block" in n for n in notes) and any("CUDA only" in n for n in notes)


def test_comm_figure_against_theory(tmp_path: Path) -> None:
    for stage, theory in ((0, 2 * PSI), (2, 2 * PSI), (3, 3 * PSI)):
        loaded = data.load(write_run(tmp_path / f"s{stage}", stage=stage, world_size=2, steps=3))
        assert data.comm_theory_elements(loaded.run) == theory
        if stage == 3:
            header = json.loads((loaded.path / "header.json").read_text())
            header["prediction"]["inputs"]["persistent_params"] = 100
            (loaded.path / "header.json").write_text(json.dumps(header))
            assert data.comm_theory_elements(data.load(loaded.path).run) == 3 * (PSI - 100) + 2 * 100
        fig = figures.comm_figure(data.comm_frame(loaded.run), theory, rank=1, stage=stage)
        for kind, elements in COMM_BY_STAGE[stage].items():
            assert list(trace(fig, kind, "y").y) == [elements] * 3
            assert list(trace(fig, kind, "y2").y) == [0.01] * 3
        assert fig.layout.shapes[0].y0 == theory
        assert fig.layout.title.text.endswith("measured / theory = 1.000")


def test_comparison_of_stages(tmp_path: Path) -> None:
    runs = [data.load(write_run(tmp_path / f"stage{s}", stage=s, world_size=4)) for s in (3, 1, 0, 2)]
    runs.append(data.load(tmp_path / "missing"))
    table = figures.comparison_table(runs)
    assert list(table["stage"]) == [0, 1, 2, 3]  # sorted by stage
    assert list(table["model_states"]) == [est.model_states_bytes(PSI, 4, s) for s in range(4)]
    assert list(table["ratio"]) == [1.0] * 4
    assert list(table["comm_theory"]) == [2 * PSI, 2 * PSI, 2 * PSI, 3 * PSI]
    fig = figures.comparison_figure(table)
    assert list(trace(fig, "measured model states").y) == [16 * PSI, 7 * PSI, 5.5 * PSI, 4 * PSI]


def test_estimator_reproduces_the_papers_tables() -> None:
    table = estimator.model_states_table({"7.5B": 7.5e9, "1T": 1e12}, estimator.PAPER_DPS)
    assert table.loc[64, ("7.5B", "P_os")] == pytest.approx(31.4, abs=0.05)
    assert table.loc[64, ("7.5B", "P_os+g")] == pytest.approx(16.6, abs=0.05)
    assert table.loc[64, ("7.5B", "P_os+g+p")] == pytest.approx(1.875)
    assert table.loc[1024, ("1T", "P_os+g+p")] == pytest.approx(15.625)
    assert table.loc[4, ("7.5B", "baseline")] == pytest.approx(120)
    fits = estimator.max_params_table(32e9, [64])
    assert fits.loc[64, "baseline"] == pytest.approx(2e9)
    assert fits.loc[64, "P_os"] == pytest.approx(7.64e9, rel=1e-3)
    assert fits.loc[64, "P_os+g+p"] == pytest.approx(128e9)
    lora = estimator.model_states_table({"LoRA": 4e6}, [8], frozen_params=7e9)  # 4M adapter on a 7B base
    assert lora.loc[8, ("LoRA", "baseline")] == pytest.approx((16 * 4e6 + 2 * 7e9) / 1e9)
    assert lora.loc[8, ("LoRA", "P_os+g+p")] == pytest.approx((16 * 4e6 + 2 * 7e9) / 8 / 1e9)
    assert estimator.parse_count("7e9", "frozen") == 7e9
    with pytest.raises(est.EstimateError, match="frozen"):
        estimator.parse_count("-1", "frozen")
    assert estimator.parse_dps("1, 4,16") == [1, 4, 16]
    with pytest.raises(est.EstimateError, match="positive integers"):
        estimator.parse_dps("1, four")
    fig = figures.estimator_figure(table)
    assert list(trace(fig, "1T P_os+g+p").y) == pytest.approx([16000, 4000, 1000, 250, 62.5, 15.625])


# --------------------------------------------------------------------------------------------------
# The command line
# --------------------------------------------------------------------------------------------------


def test_cli_rejects_bad_paths_with_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["dashboard", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "nope: no such directory" in err
    (tmp_path / "empty").mkdir()
    assert cli_main(["dashboard", str(tmp_path / "empty")]) == 2
    assert "holds no profile run directory" in capsys.readouterr().err


def test_cli_command_line(tmp_path: Path) -> None:
    run = write_run(tmp_path / "run")
    args = build_parser_for_tests().parse_args(["dashboard", str(run), "--port", "9999"])
    command = build_command(args)
    assert command[1:4] == ["-m", "streamlit", "run"] and command[4].endswith("dashboard/app.py")
    flags = dict(zip(command[5:-3:2], command[6:-2:2]))
    assert flags["--server.address"] == "127.0.0.1" and flags["--server.port"] == "9999"
    assert flags["--server.headless"] == "true" and flags["--browser.gatherUsageStats"] == "false"
    assert command[-3:] == ["--", "--run", str(run.resolve())]


# --------------------------------------------------------------------------------------------------
# The pipeline view (synthetic pp=2 x dp=1 profile, format 2, exact figures)
# --------------------------------------------------------------------------------------------------

PP_BUSY = {0: 0.8, 1: 0.6}
"""Busy seconds per pp rank in every synthetic step; the window is 1 s, so idle = 1 - busy."""
PP_P2P = 4096


def write_pp_run(path: Path, steps: int = 2) -> Path:
    """A synthetic pp=2 x dp=1 run (ZeRO-1 over a dp group of one: Ψ_s = PSI per stage)."""
    path.mkdir(parents=True, exist_ok=True)
    states = model_state_roles(1, 1)
    header = {"format_version": 2, "run_id": "pp", "world_size": 1, "global_world_size": 2, "stage": 1,
              "model": {"class": "Tiny", "num_params": PSI}, "prediction": None,
              "pipeline": {"pp": 2, "dp": 1, "schedule": "1F1B", "n_micro": 4, "stages_per_rank": 1, "num_stages": 2,
                           "zero_stage": 1, "accumulation": "local", "stage3_gather": None, "bubble_estimate": 0.25,
                           "ranks": [{"pp_rank": r, "global_ranks": [r], "stages": [r], "params": PSI, "tied": 0,
                                      "blocks": 1, "model_states_by_role": dict(states),
                                      "model_state_bytes": sum(states.values()), "comm_elements_per_step": {}}
                                     for r in (0, 1)]}}
    (path / "header.json").write_text(json.dumps(header))
    for rank in (0, 1):
        coords = {"pp_rank": rank, "dp_rank": 0}
        base = {"roles": states, "model_state_bytes": sum(states.values()), "comm": {}, **coords,
                "allocator": _allocator(allocated_at(rank, 0, 0))}
        records = [{"kind": "event", "step": 0, "phase": None, "t": 0.0, "event": "start", "format_version": 2,
                    "run_id": "pp", "rank": rank, "global_world_size": 2, "dp_rank": 0, "world_size": 1,
                    "stages": [rank], **base}]
        for step in range(steps):
            busy = PP_BUSY[rank]
            spans = [["forward", rank, m, 0.1 * m, 0.1 * m + busy / 8] for m in range(4)]
            spans += [["backward", rank, m, 0.5 + 0.1 * m, 0.5 + 0.1 * m + busy / 8] for m in range(4)]
            clock = {"wall_seconds": 1.0, "busy_seconds": busy, "idle_seconds": 1.0 - busy,
                     "bubble_fraction": (1.0 - busy) / busy, "idle_fraction": 1.0 - busy, "n_micro": 4,
                     "micro_shape": [2, 16], "actions": {"forward": 4, "backward": 4}, "stages": [rank],
                     "bubble_estimate": 0.25, "spans": spans,
                     "p2p": {"send": {"calls": 4, "bytes": PP_P2P}, "recv": {"calls": 4, "bytes": PP_P2P}},
                     "p2p_estimate": {"send": PP_P2P, "recv": PP_P2P}}
            records.append({"kind": "step", "step": step, "phase": None, "t": step + 1.0, "seconds": 1.0,
                            "micro_batches": 4, **base, "allocator_max": _allocator(1), "pipeline": clock})
        records.append({"kind": "event", "step": steps, "phase": None, "t": steps + 1.0, "event": "stop", **base})
        (path / f"rank-{rank}.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
    return path


def test_pipeline_view_tables_and_figures(tmp_path: Path) -> None:
    from dashboard import pipeline as view

    loaded = data.load(write_pp_run(tmp_path / "pp"))
    assert loaded.error is None and loaded.run.warnings == []
    frame = view.stage_frame(loaded.run)
    assert list(frame["pp rank"]) == [0, 1] and list(frame["ranks"]) == ["0", "1"]
    assert list(frame["bubble idle/busy"]) == pytest.approx([0.25, 0.4 / 0.6])
    assert list(frame["(P-1)/(vM)"]) == [0.25, 0.25] and list(frame["idle/wall"]) == pytest.approx([0.2, 0.4])
    states = sum(model_state_roles(1, 1).values())
    assert list(frame["model states (B)"]) == [states, states] == list(frame["cost model (B)"])
    assert list(frame["P2P sent (B)/step"]) == [PP_P2P] * 2 == list(frame["P2P cost model (B)"])
    fig = view.pipeline_figure(loaded.run)
    assert decode(trace(fig, "measured idle / busy (median)").y) == pytest.approx([0.25, 0.4 / 0.6])
    assert list(decode(trace(fig, "(P - 1)/(vM)").y)) == [0.25, 0.25]
    # measured beside the cost model, per stage: [pp0 measured, pp0 cost model, pp1 measured, pp1 cost model]
    assert list(decode(trace(fig, "param_full").y)) == [2 * PSI] * 4
    assert list(decode(trace(fig, "P2P sent").y)) == [PP_P2P] * 2
    assert "pp=2 x dp=1, 1F1B, 4 micro-batches" in fig.layout.title.text
    assert view.steps_with_spans(loaded.run) == [0, 1]
    schedule = view.schedule_figure(loaded.run, 1)
    forward = [t for t in schedule.data if t.name == "forward"]
    assert len(forward) == 8 and sorted(round(float(t.x[0]), 6) for t in forward)[::4] == [0.075, 0.1]
    # a run without pipeline: one explanatory figure, an empty table
    plain = data.load(write_run(tmp_path / "plain"))
    assert view.stage_frame(plain.run).empty
    assert "not a pipeline-parallel run" in view.pipeline_figure(plain.run).layout.title.text


def test_pipeline_page(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    app = run_page([write_pp_run(tmp_path / "pp")], "Pipeline stages", monkeypatch)
    assert not app.error and "Pipeline stages: pp=2 x dp=1" in page_titles(app)
    assert "Schedule of step 1" in page_titles(app) and len(app.dataframe) == 1


# --------------------------------------------------------------------------------------------------
# The Streamlit pages
# --------------------------------------------------------------------------------------------------


def run_page(runs: list[Path], view: str, monkeypatch: pytest.MonkeyPatch, **state: Any) -> Any:
    from streamlit.testing.v1 import AppTest

    from dashboard.pages import RUNS_ENV

    monkeypatch.setenv(RUNS_ENV, ":".join(map(str, runs)))
    app = AppTest.from_file(str(Path(data.__file__).parent / "app.py"), default_timeout=60)
    app.session_state["view"] = view
    for key, value in state.items():
        app.session_state[key] = value
    app.run()
    assert not app.exception, [e.value for e in app.exception]
    return app


def page_titles(app: Any) -> str:
    return " ".join(json.loads(chart.proto.spec)["layout"]["title"]["text"] for chart in app.get("plotly_chart"))


EXPECTED_TITLES = {"Memory by role": "Bytes by role", "Timeline": "Memory over steps", "Fragmentation":
                   "Fragmentation over time", "Communication": "Communication per step",
                   "Pipeline stages": "Pipeline stages",
                   "Compare runs": "Runs side by side", "Estimator": "Per-device model-state memory",
                   "Planner": "Plan: configurations"}


def test_every_page_runs_on_good_crashed_and_bad_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    parent = tmp_path / "runs"
    for stage in (0, 3):
        write_run(parent / f"stage{stage}", stage=stage, world_size=2)
    write_run(parent / "crashed", cut_last_line_of=0)
    bad = write_run(parent / "zz-bad")
    (bad / "rank-1.jsonl").write_text("not json\n{}\n")
    from dashboard.pages import VIEWS

    for view in VIEWS:
        app = run_page([parent], view, monkeypatch)
        assert EXPECTED_TITLES[view] in page_titles(app), view
        assert any("zz-bad" in e.value and "malformed JSON" in e.value for e in app.error)
    crashed = run_page([parent], "Memory by role", monkeypatch, run_index=0)
    assert any("last line cut off" in w.value for w in crashed.warning)
    broken = run_page([parent], "Timeline", monkeypatch, run_index=3)
    assert any(e.value.startswith("Cannot show this run") for e in broken.error)
    assert not broken.get("plotly_chart")


def test_estimator_page_with_a_config_and_bad_input(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers import GPT2Config

    GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=100, n_positions=32).save_pretrained(tmp_path / "cfg")
    psi = est.params_from_config(tmp_path / "cfg")
    app = run_page([], "Estimator", monkeypatch, est_source="Hugging Face config path",
                   est_config=str(tmp_path / "cfg"))
    assert any(f"Ψ={psi:.3g}" in str(t.value.columns) for t in app.table)
    app = run_page([], "Estimator", monkeypatch, est_dps="4, x")
    assert any("positive integers" in e.value for e in app.error)
    app = run_page([], "Estimator", monkeypatch, est_source="Hugging Face config path",
                   est_config=str(tmp_path / "nowhere.json"))
    assert any("not found" in e.value for e in app.error)


def test_planner_page_ranks_and_explains(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The Planner view: the paper's 7.5B model on 64 x 32 GB (its default), the choice named, the rejected
    configurations with their reasons; a config path and a bad Ψ."""
    app = run_page([], "Planner", monkeypatch)
    assert any(m.value.startswith("**Choice:** stage ") for m in app.markdown)
    frames = [f.value for f in app.dataframe]
    assert any("why not" in frame.columns and frame["why not"].str.startswith("needs ").all() for frame in frames)
    from transformers import BertConfig

    BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
               vocab_size=100).save_pretrained(tmp_path / "bert")
    app = run_page([], "Planner", monkeypatch, plan_source="Hugging Face config path", plan_model_H=str(tmp_path / "bert"),
                   plan_seq=64, plan_batch=64)
    assert any(m.value.startswith("**Choice:**") for m in app.markdown)
    app = run_page([], "Planner", monkeypatch, plan_model_Ψ="lots")
    assert any("Ψ must be a number" in e.value for e in app.error)


def test_a_run_still_being_written_reloads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write_run(tmp_path / "live", steps=2)
    first = data.run_signature(path)
    from dashboard.pages import load_all

    assert len(data.step_frame(load_all([path])[0].run)) == 4
    write_run(path, steps=5)
    assert data.run_signature(path) != first
    assert len(data.step_frame(load_all([path])[0].run)) == 10


# --------------------------------------------------------------------------------------------------
# A real profile: 2 gloo ranks, hfzero.prepare + ZeroProfiler
# --------------------------------------------------------------------------------------------------


def _profile_tiny_model(rank: int, world_size: int, root: str) -> None:
    import torch

    import hfzero
    from hfzero.profiler import ZeroProfiler
    from hfzero.testing.models import micro_batches, tiny_causal_lm, token_batches

    for stage in (2, 3):
        model = tiny_causal_lm("gpt2", hidden=32, layers=2)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        config = hfzero.ZeroConfig(stage=stage, dtype="bf16", reduce_bucket_size=5000,
                                   param_persistence_threshold=0)
        model, optimizer = hfzero.prepare(model, optimizer, config)
        with ZeroProfiler(model, optimizer, f"{root}/stage{stage}"):
            for batch in token_batches(3, 4, 16):
                (tokens,) = micro_batches(batch, rank, world_size, 1)
                model(input_ids=tokens, labels=tokens).loss.backward()
                optimizer.step()
                optimizer.zero_grad()
    # pp=2 x dp=1: the custom-loop pipeline API under the profiler
    model = tiny_causal_lm("llama", hidden=32, layers=2)
    pipe = hfzero.pipeline(model, torch.optim.AdamW(model.parameters(), lr=1e-3), hfzero.ZeroConfig(stage=2),
                           pp_size=2, n_microbatches=2)
    with ZeroProfiler(pipe, None, f"{root}/pipeline"):
        for batch in token_batches(2, 4, 16):
            pipe.train_step(batch)


@pytest.fixture(scope="module")
def real_runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from hfzero.testing import run_distributed

    root = tmp_path_factory.mktemp("real")
    run_distributed(_profile_tiny_model, 2, str(root), timeout=120)
    return root


def test_real_profile_figures_and_pages(real_runs: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for stage in (2, 3):
        loaded = data.load(real_runs / f"stage{stage}")
        assert loaded.error is None and loaded.run.warnings == []
        assert sorted(loaded.run.ranks) == [0, 1]
        for rank in loaded.summary["ranks"]:
            assert rank["steps"] == 3 and rank["ratio"] == pytest.approx(1.0, rel=0.05)
        fig = figures.comm_figure(data.comm_frame(loaded.run), data.comm_theory_elements(loaded.run), rank=0,
                                  stage=stage)
        ratio = float(fig.layout.title.text.rsplit("=", 1)[1])
        assert 1.0 <= ratio < 1.1  # padding and the clipping all-reduce come on top of 2Ψ / 3Ψ
    from dashboard import pipeline as pipeline_view

    piped = data.load(real_runs / "pipeline")
    assert piped.error is None and piped.run.warnings == [] and sorted(piped.run.ranks) == [0, 1]
    frame = pipeline_view.stage_frame(piped.run)
    assert list(frame["steps"]) == [2, 2] and list(frame["P2P sent (B)/step"]) == list(frame["P2P cost model (B)"])
    assert list(frame["(P-1)/(vM)"]) == [0.5, 0.5] and (frame["bubble idle/busy"] >= 0).all()
    from dashboard.pages import VIEWS

    for view in VIEWS:
        for index in (0, 1, 2):
            app = run_page([real_runs], view, monkeypatch, run_index=index)
            assert not app.error and EXPECTED_TITLES[view] in page_titles(app), view


def test_the_dashboard_modules_never_import_torch_distributed() -> None:
    sources = [p.read_text() for p in Path(data.__file__).parent.glob("*.py")]
    assert not any("torch.distributed" in s or "import torch" in s for s in sources)


def test_memory_by_role_accounts_for_the_whole_peak(tmp_path: Path) -> None:
    """Activations as roles beside their estimate, and the rest of the rank's peak as "other /
    allocator overhead", from the profiler's peak decomposition: the parts add up to the peak."""
    from hfzero.profiler.decompose import decompose

    path = write_run(tmp_path / "run", stage=2, world_size=2, steps=2)
    header = json.loads((path / "header.json").read_text())
    header["activation_prediction"] = {"per_layer": 1500.0, "layers": 3000.0, "checkpoints": 0.0,
                                       "checkpoints_host": 0.0, "head": 1000.0, "saved": 4000.0, "recompute": 0.0,
                                       "total": 4000.0, "inputs": {}}
    (path / "header.json").write_text(json.dumps(header))
    states = {k for k in model_state_roles(2, 2)}
    for rank in range(2):
        records = [json.loads(line) for line in (path / f"rank-{rank}.jsonl").read_text().splitlines()]
        for record in records:
            if record["kind"] == "step" or (record.get("phase"), record.get("edge")) == ("forward", "end"):
                record["roles"] = {**record["roles"], "activations": 3000 + rank, "act_checkpoint": 1000}
            if record["kind"] == "step":
                record["peak"] = {**decompose(record["roles"], record["allocator"], states), "phase": "step",
                                  "edge": "end", "peak_total": None}
        (path / f"rank-{rank}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    loaded = data.load(path)
    fig = figures.memory_by_role_figure(loaded)
    kinds = ["model states", "formula", "transient", "activations", "estimate"]
    assert list(fig.data[0].x[1][:5]) == kinds
    assert list(trace(fig, "activations").y[:5]) == [0, 0, 0, 3000, 0]
    assert list(trace(fig, "act_checkpoint").y[:5]) == [0, 0, 0, 1000, 0]
    assert list(trace(fig, "estimate: layers (no checkpointing)").y[:5]) == [0, 0, 0, 0, 3000]
    assert list(trace(fig, "activations: measured / estimate").text) == ["1.000"] * 2
    rows = figures.whole_peak_rows(loaded)
    last = allocated_at(1, 1, 5)  # rank 1's largest peak: the last step's end (RSS = 3 x allocated)
    row = rows[1]
    assert row["peak (bytes)"] == 3 * last and row["activations + checkpoints"] == 4001
    parts = ("model states", "transient", "activations + checkpoints", "other / allocator overhead")
    assert sum(row[p] for p in parts) == row["peak (bytes)"]
    # the right panel: the whole peak = engine roles + the overhead's parts (untracked, runtime, slack)
    split = data.overhead_split(loaded.run)[1]
    assert sum(split.values()) == pytest.approx(row["other / allocator overhead"])
    whole = [trace(fig, name).y[1] for name in ("engine roles (the left panel)", "untracked live memory",
                                                 "framework runtime", "allocator slack and the rest")]
    assert sum(whole) == pytest.approx(row["peak (bytes)"])
    assert row["measured / estimate"] == pytest.approx(4001 / 4000)
    assert figures.peak_sentence(loaded).startswith("Within its prediction (model states 1.000 of the formula, "
                                                    "activations 1.000 of the estimate")


def test_first_view_of_the_main_job_profile() -> None:
    """The main job's profile (examples/main_job.sh: MiniLM encoder classifier, ZeRO-2, 2 ranks; kept in
    tests/data): the encoder estimate within 10% of the measured activations, the sentence under the chart,
    the overhead decomposed, a legend of three groups (the browser test checks that no label is cut)."""
    loaded = data.load(Path(__file__).parent / "data" / "main_job_profile")
    assert loaded.error is None
    predicted = data.activation_prediction(loaded.run)
    assert predicted["inputs"]["model"] == "encoder"
    for rank, measured in data.activation_peaks(loaded.run).items():
        assert sum(measured.values()) == pytest.approx(predicted["saved"], rel=0.10), rank
    split, whole = data.overhead_split(loaded.run), data.whole_peak(loaded.run)
    for rank in whole:
        assert sum(split[rank].values()) == pytest.approx(whole[rank]["overhead"])
        assert split[rank]["runtime"] > 100e6  # torch, transformers and the interpreter on a CPU rank
    sentence = figures.peak_sentence(loaded)
    assert sentence.startswith("Within its prediction") and "framework runtime" in sentence
    fig = figures.memory_by_role_figure(loaded)
    shown = [t for t in fig.data if t.showlegend is not False]
    assert len(shown) <= 12 and len({t.legendgroup for t in shown}) <= 6
    legend = figures.legend_html(fig)
    assert legend.count("<b>") == 3 and "measured, by role:" in legend and "framework runtime" in legend


def test_every_view_renders_the_first_cuda_profile(monkeypatch: pytest.MonkeyPatch) -> None:
    """The profile of the first GPU run (2026-11-28, one H200, torch 2.11: `hfzero run --bf16 --zero_stage 2
    --zero_profile_dir` on a 26.8K-parameter Llama, world 1; kept in tests/data/cuda_profile). It was written
    before CUDA samples carried a fragmentation figure (null then): the reader fills it from the two counters
    it is made of, so every sample and step has one. Every view renders it: the formula met, a world of one
    moving nothing, sizes in kB where MB would read 0. (Estimator and Planner read no run.)"""
    path = Path(__file__).parent / "data" / "cuda_profile"
    loaded = data.load(path)
    assert loaded.error is None and loaded.run.header["device_type"] == "cuda" and loaded.run.warnings == []
    timeline, steps = data.timeline_frame(loaded.run), data.step_frame(loaded.run)
    assert len(steps) == 3 and timeline["fragmentation"].notna().all() and steps["fragmentation"].notna().all()
    np.testing.assert_allclose(timeline["fragmentation"], timeline["inactive_split"] / timeline["reserved"])
    assert 0 < timeline["fragmentation"].min() <= timeline["fragmentation"].max() < 1
    figure, notes = figures.fragmentation_figure(timeline, steps)
    assert [a.text for a in figure.layout.annotations] == ["fragmentation ratio (free but held / held)",
                                                           "in use (allocated) vs free but held (reserved - allocated)"]
    assert notes == ["largest free block: only with a CUDA allocator snapshot (ZeroProfiler(cuda_snapshot=True))",
                     "allocator retries and OOMs: none (all zero)"]
    sentence = figures.peak_sentence(loaded)
    assert sentence.startswith("Within its prediction (model states 1.000 of the formula, activations 1.000")
    assert "is 268 kB of engine roles (model states 214 kB, transient 54 kB" in sentence  # not "0 MB"
    comm = figures.comm_figure(data.comm_frame(loaded.run), data.comm_theory_elements(loaded.run), rank=0,
                               stage=2, world_size=1)
    assert "world of one rank moves nothing" in comm.layout.annotations[0].text
    from dashboard.pages import RUN_VIEWS

    for view in (*RUN_VIEWS, "Compare runs"):  # the views that show a run (Estimator and Planner read none)
        app = run_page([path], view, monkeypatch)
        assert not app.error and EXPECTED_TITLES[view] in page_titles(app), view


def test_comm_view_shows_bytes_between_nodes(tmp_path: Path) -> None:
    """Issue 22: step records whose comm entries carry the node split show it in the frame and the title;
    older ones (write_run's) read as NaN and the title does not mention nodes."""
    path = write_run(tmp_path / "split", stage=2, world_size=2, steps=2)
    old = data.comm_frame(data.load(path).run)
    assert old["inter_node_bytes"].isna().all()
    assert "between nodes" not in figures.comm_figure(old, None, rank=0, stage=2).layout.title.text
    for rank_file in path.glob("rank*.jsonl"):
        lines = [json.loads(line) for line in rank_file.read_text().splitlines()]
        for record in lines:
            for stats in (record.get("comm") or {}).values():
                stats["inter_node_bytes"] = stats["bytes"] // 2
        rank_file.write_text("".join(json.dumps(r) + "\n" for r in lines))
    comm = data.comm_frame(data.load(path).run)
    assert list(comm["inter_node_bytes"]) == list(comm["bytes"] // 2)
    title = figures.comm_figure(comm, None, rank=0, stage=2).layout.title.text
    assert title.endswith(f" ({PSI * 2:,.0f} bytes between nodes per step)"), title


def test_ranks_grouped_by_sp_rank(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under sequence parallelism (records with sp_rank) the memory view's table groups the ranks by sp rank
    over the dp replicas; without it there is no such table."""
    loaded = data.load(write_run(tmp_path / "sp", stage=3, world_size=4, sp=2))
    page = run_page([tmp_path / "sp"], "Memory by role", monkeypatch)
    assert any(c.value.startswith("Sequence parallelism") for c in page.caption) and not page.error
    rows = data.sp_group_rows(loaded.summary)
    assert [(r["sp rank"], r["ranks"], r["dp replicas"]) for r in rows] == [(0, "0, 2", "0, 1"), (1, "1, 3", "0, 1")]
    assert [r["all-to-all bytes / step, mean"] for r in rows] == [200.0, 400.0]
    states = sum(model_state_roles(3, 4).values())
    assert all(r["model states, max (bytes)"] == states and r["step seconds, median"] == 0.3 for r in rows)
    assert data.sp_group_rows(data.load(write_run(tmp_path / "plain", stage=3, world_size=4)).summary) == []
