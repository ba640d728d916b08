"""``hfzero profile summary``: the JSON contract, the table, and one-line errors with exit code 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_profiler_reader import _good_records, _write_run

from hfzero.cli import main


def test_summary_json_contract(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = _write_run(tmp_path / "run", {0: _good_records(0), 1: _good_records(1)})
    assert main(["profile", "summary", str(root), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["stage"] == 2 and out["world_size"] == 2
    assert [r["model_state_bytes"] for r in out["ranks"]] == [1010, 1010]
    assert out["ranks"][0]["ratio"] == pytest.approx(1.01)


def test_summary_table_and_crash_warning(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = _write_run(tmp_path / "run", {0: _good_records(0), 1: _good_records(1)})
    with open(root / "rank-1.jsonl", "a") as f:
        f.write('{"kind": "ph')
    assert main(["profile", "summary", str(root)]) == 0
    captured = capsys.readouterr()
    lines = captured.out.splitlines()
    assert lines[0].startswith(f"run {'a' * 32}: Tiny, Ψ = 50, stage 2, N_d = 2")
    assert "2Ψ + (2 + 12)Ψ/N_d" in lines[1]
    assert lines[2].split()[:2] == ["rank", "steps"]
    assert "1.0100" in lines[3] and "(crashed)" in lines[4] and "(crashed)" not in lines[3]
    assert captured.err.startswith("warning: ") and "cut off" in captured.err


@pytest.mark.parametrize("make", ["missing", "not_a_profile", "malformed"])
def test_bad_run_dir_is_one_line_and_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str], make: str) -> None:
    root = tmp_path / "run"
    if make != "missing":
        _write_run(root, {0: _good_records(0)})
    if make == "not_a_profile":
        (root / "header.json").write_text('{"hello": "world"}')
    if make == "malformed":
        (root / "rank-0.jsonl").write_text("not json\n")
    assert main(["profile", "summary", str(root), "--json"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert len(captured.err.strip().splitlines()) == 1
    assert captured.err.startswith("hfzero profile summary: error: ") and str(root) in captured.err


def test_summary_of_a_pipeline_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A format-2 pp=2 x dp=1 run: per-rank predictions are the stage's, and a per-stage table follows."""
    from test_dashboard import PP_P2P, write_pp_run

    root = write_pp_run(tmp_path / "pp")
    assert main(["profile", "summary", str(root), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [(r["rank"], r["pp_rank"], r["ratio"]) for r in out["ranks"]] == [(0, 0, 1.0), (1, 1, 1.0)]
    assert [s["bubble_fraction"] for s in out["pipeline"]] == pytest.approx([0.25, 0.4 / 0.6])
    assert [s["p2p_bytes_per_step"] for s in out["pipeline"]] == [{"send": PP_P2P, "recv": PP_P2P}] * 2
    assert main(["profile", "summary", str(root)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "per pipeline stage" in lines[1] and lines[-4].startswith("pipeline stages")
    assert lines[-3].split()[:2] == ["pp", "rank"] and lines[-1].split()[6:8] == ["0.667", "0.250"]


def test_version_1_profile_reads_as_a_run_without_pipeline(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = _write_run(tmp_path / "run", {0: _good_records(0), 1: _good_records(1)})
    assert json.loads((root / "header.json").read_text())["format_version"] == 1
    assert main(["profile", "summary", str(root), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["pipeline"] is None and [r["pp_rank"] for r in out["ranks"]] == [0, 0]
