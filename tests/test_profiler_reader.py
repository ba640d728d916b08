"""The profile reader on hand-written run directories: valid runs, crashes and every kind of bad file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hfzero.profiler.reader import ProfileFormatError, load_run, summarize

RUN_ID = "a" * 32
PREDICTED = 1000.0


def _header(**overrides: object) -> dict:
    header = {"format_version": 1, "run_id": RUN_ID, "world_size": 2, "global_world_size": 2, "stage": 2,
              "model": {"class": "Tiny", "num_params": 50},
              "prediction": {"model_state_bytes": PREDICTED, "formula": "2Ψ + (2 + 12)Ψ/N_d"}}
    header.update(overrides)
    return header


def _start(rank: int, run_id: str = RUN_ID) -> dict:
    return {"kind": "event", "event": "start", "step": 0, "phase": None, "t": 0.0, "format_version": 1,
            "run_id": run_id, "rank": rank, "dp_rank": rank, "roles": {"param_full": 100},
            "model_state_bytes": 100, "allocator": {"rss": 10}, "comm": {}}


def _phase(step: int, phase: str, edge: str, model_state: int, comm: dict | None = None) -> dict:
    return {"kind": "phase", "step": step, "phase": phase, "edge": edge, "t": 0.1 * step,
            "roles": {"param_full": 100, "grad_shard": model_state - 100}, "model_state_bytes": model_state,
            "allocator": {"rss": 10 + model_state, "fragmentation": 0.25, "device": "cpu"}, "comm": comm or {}}


def _step(step: int, model_state: int, elements: int) -> dict:
    comm = {"reduce_scatter": {"calls": 1, "elements": elements, "bytes": 2 * elements, "seconds": 0.01}}
    return {"kind": "step", "step": step, "phase": None, "t": 0.1 * step + 0.05, "seconds": 0.1,
            "roles": {"param_full": 100, "grad_shard": model_state - 100}, "model_state_bytes": model_state,
            "allocator": {"rss": 20}, "allocator_max": {"rss": 10 + model_state}, "comm": comm}


def _lines(records: list[dict]) -> str:
    return "".join(json.dumps(r) + "\n" for r in records)


def _write_run(root: Path, rank_records: dict[int, list[dict]], header: dict | None = None) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "header.json").write_text(json.dumps(header or _header()))
    for rank, records in rank_records.items():
        (root / f"rank-{rank}.jsonl").write_text(_lines(records))
    return root


def _good_records(rank: int) -> list[dict]:
    return [_start(rank),
            _phase(0, "backward", "end", 900), _step(0, 900, 60),
            _phase(1, "backward", "end", 1010), _step(1, 1010, 80),
            {"kind": "event", "event": "stop", "step": 2, "phase": None, "t": 0.3, "roles": {},
             "model_state_bytes": 0, "allocator": {}, "comm": {}}]


def test_load_and_summarize_a_complete_run(tmp_path: Path) -> None:
    run = load_run(_write_run(tmp_path / "run", {0: _good_records(0), 1: _good_records(1)}))
    assert run.warnings == [] and run.stage == 2 and run.world_size == 2 and run.run_id == RUN_ID
    assert [r.rank for r in run.ranks.values()] == [0, 1]
    assert run.ranks[1].start["dp_rank"] == 1 and run.ranks[1].stopped
    assert len(run.ranks[0].of_kind("step")) == 2

    summary = summarize(run)
    assert summary["stage"] == 2 and summary["world_size"] == 2 and summary["model_class"] == "Tiny"
    rank0 = summary["ranks"][0]
    assert rank0["model_state_bytes"] == 1010
    assert rank0["predicted_model_state_bytes"] == PREDICTED
    assert rank0["ratio"] == pytest.approx(1.01)
    assert rank0["roles_peak"] == {"param_full": 100, "grad_shard": 910}
    assert rank0["allocator_peak"]["rss"] == 1020 and rank0["allocator_peak"]["fragmentation"] == 0.25
    assert "device" not in rank0["allocator_peak"]
    assert rank0["comm_per_step"]["reduce_scatter"] == {"calls": 1, "elements": 70, "bytes": 140, "seconds": 0.01}
    assert rank0["comm_elements_per_step"] == 70 and rank0["comm_bytes_per_step"] == 140
    assert rank0["steps"] == 2 and rank0["step_seconds"] == 0.1 and not rank0["truncated"]
    json.dumps(summary)  # the CLI's --json output must serialize


def test_truncated_last_line_is_a_warning_not_an_error(tmp_path: Path) -> None:
    root = _write_run(tmp_path / "run", {0: _good_records(0)})
    crashed = _lines(_good_records(1)[:3]) + json.dumps(_step(1, 1010, 80))[:37]
    (root / "rank-1.jsonl").write_text(crashed)
    run = load_run(root)
    assert run.ranks[1].truncated and len(run.ranks[1].records) == 3
    assert not run.ranks[1].stopped
    assert len(run.warnings) == 1 and "rank-1.jsonl:4" in run.warnings[0] and "cut off" in run.warnings[0]
    assert summarize(run)["ranks"][1]["truncated"]


def test_complete_last_line_without_newline_is_kept(tmp_path: Path) -> None:
    root = _write_run(tmp_path / "run", {0: _good_records(0)})
    (root / "rank-0.jsonl").write_text(_lines(_good_records(0)).rstrip("\n"))
    run = load_run(root)
    assert run.warnings[-1].endswith("no rank file for rank(s) [1] of 2")
    assert not run.ranks[0].truncated and run.ranks[0].stopped


def test_empty_rank_file_and_missing_rank_are_warnings(tmp_path: Path) -> None:
    root = _write_run(tmp_path / "run", {0: []}, header=_header(global_world_size=3))
    run = load_run(root)
    assert run.ranks[0].records == [] and run.ranks[0].start is None
    assert any("empty rank file" in w for w in run.warnings)
    assert any("[1, 2]" in w for w in run.warnings)
    assert summarize(run)["ranks"][0]["model_state_bytes"] is None


def test_malformed_line_names_file_and_line(tmp_path: Path) -> None:
    root = _write_run(tmp_path / "run", {0: _good_records(0)})
    lines = _lines(_good_records(0)).splitlines(keepends=True)
    lines[2] = '{"kind": "step", "step": 0,\n'
    (root / "rank-0.jsonl").write_text("".join(lines))
    with pytest.raises(ProfileFormatError, match=r"rank-0\.jsonl:3: malformed JSON") as info:
        load_run(root)
    assert info.value.line == 3 and info.value.path.name == "rank-0.jsonl"


def test_record_without_kind_is_rejected(tmp_path: Path) -> None:
    records = _good_records(0)
    records[1] = {"step": 0, "t": 1.0}
    with pytest.raises(ProfileFormatError, match=r"rank-0\.jsonl:2: record kind None"):
        load_run(_write_run(tmp_path / "run", {0: records}))


def test_missing_header(tmp_path: Path) -> None:
    root = tmp_path / "run"
    root.mkdir()
    (root / "rank-0.jsonl").write_text(_lines(_good_records(0)))
    with pytest.raises(ProfileFormatError, match="missing header.json"):
        load_run(root)
    with pytest.raises(ProfileFormatError, match="not a directory"):
        load_run(tmp_path / "nowhere")


def test_malformed_header(tmp_path: Path) -> None:
    root = _write_run(tmp_path / "run", {0: _good_records(0)})
    (root / "header.json").write_text('{\n  "format_version": 1,\n  "run_id": \n}')
    with pytest.raises(ProfileFormatError, match=r"header\.json:4: malformed JSON"):
        load_run(root)


@pytest.mark.parametrize("version, message", [(None, "no format_version"), (3, "unknown format_version 3")])
def test_foreign_or_future_header(tmp_path: Path, version: int | None, message: str) -> None:
    header = _header()
    if version is None:
        del header["format_version"]
    else:
        header["format_version"] = version
    with pytest.raises(ProfileFormatError, match=message):
        load_run(_write_run(tmp_path / "run", {0: _good_records(0)}, header=header))


def test_foreign_rank_file(tmp_path: Path) -> None:
    records = _good_records(0)
    records[0] = {"kind": "event", "event": "start", "step": 0, "t": 0.0, "run_id": RUN_ID, "rank": 0}
    with pytest.raises(ProfileFormatError, match=r"rank-0\.jsonl:1: no format_version"):
        load_run(_write_run(tmp_path / "run", {0: records}))
    records[0] = _phase(0, "forward", "begin", 100)
    with pytest.raises(ProfileFormatError, match="not a start event"):
        load_run(_write_run(tmp_path / "run2", {0: records}))


def test_rank_file_of_another_run(tmp_path: Path) -> None:
    records = _good_records(1)
    records[0] = _start(1, run_id="b" * 32)
    with pytest.raises(ProfileFormatError, match=r"rank-1\.jsonl:1: rank file of another run"):
        load_run(_write_run(tmp_path / "run", {0: _good_records(0), 1: records}))


def test_rank_file_named_for_another_rank(tmp_path: Path) -> None:
    with pytest.raises(ProfileFormatError, match="file name says rank 1"):
        load_run(_write_run(tmp_path / "run", {1: _good_records(0)}))


def test_reading_profiles_does_not_import_torch() -> None:
    """The dashboard reads profiles without torch (let alone torch.distributed)."""
    import subprocess
    import sys

    code = ("import sys, hfzero.profiler, hfzero.profiler.reader, hfzero.cli.profile; "
            "print(sorted(m for m in ('torch', 'torch.distributed') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
