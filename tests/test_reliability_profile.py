"""Issue 15: profile runs under bad input.

- a header claiming a huge world size costs work bounded by the files on disk (finding 3);
- a wrong-typed or missing header field and a malformed record are ProfileFormatError naming the
  file (``hfzero profile summary`` prints one line and exits 2), and in the dashboard one malformed
  run never stops the others from loading and showing (finding 4).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from hfzero.profiler.reader import ProfileFormatError, load_run, summarize
from test_dashboard import run_page, write_run


def _set_header(run: Path, **changes) -> None:
    header = json.loads((run / "header.json").read_text())
    header.update(changes)
    for key in [k for k, v in changes.items() if v is _DROP]:
        del header[key]
    (run / "header.json").write_text(json.dumps(header))


_DROP = object()


def test_huge_global_world_size_is_bounded_by_the_files(tmp_path: Path) -> None:
    run = write_run(tmp_path / "run")
    _set_header(run, global_world_size=10_000_000_000)
    started = time.perf_counter()
    loaded = load_run(run)
    assert time.perf_counter() - started < 5
    warning = next(w for w in loaded.warnings if "no rank file" in w)
    assert "[2, 3, 4, 5, 6, 7, 8, 9] and 9999999990 more of 10000000000" in warning
    assert summarize(loaded)["ranks"]


@pytest.mark.parametrize("changes, message", [
    ({"model": "gpt2"}, "model is 'gpt2', not an object"),
    ({"model": {"class": 3}}, "model.class"),
    ({"world_size": "2"}, "world_size is '2'"),
    ({"global_world_size": 0}, "global_world_size is 0"),
    ({"stage": 7}, "stage is 7"),
    ({"stage": _DROP}, "lacks required key 'stage'"),
    ({"run_id": 5}, "run_id is 5"),
    ({"prediction": [1]}, "prediction is [1]"),
    ({"prediction": {"model_state_bytes": "big"}}, "prediction.model_state_bytes"),
    ({"prediction": {"inputs": {"dp": "two"}}}, "prediction.inputs"),
])
def test_wrong_typed_header_is_a_format_error_and_one_cli_line(tmp_path: Path, capsys, changes, message) -> None:
    from hfzero.cli import main

    run = write_run(tmp_path / "run")
    _set_header(run, **changes)
    with pytest.raises(ProfileFormatError, match="header.json: .*" + message.replace("[", r"\[")):
        load_run(run)
    assert main(["profile", "summary", str(run)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "header.json" in err[0]


@pytest.mark.parametrize("record, message", [
    ({"roles": [1, 2]}, "roles is [1, 2], not an object"),
    ({"roles": {"param_full": "x"}}, "roles.param_full"),
    ({"comm": {"all_gather": 3}}, "comm.all_gather"),
    ({"allocator": "full"}, "allocator is 'full'"),
    ({"model_state_bytes": "big"}, "model_state_bytes"),
])
def test_malformed_record_names_file_and_line(tmp_path: Path, record, message) -> None:
    run = write_run(tmp_path / "run")
    lines = (run / "rank-0.jsonl").read_text().splitlines()
    lines[2] = json.dumps({**json.loads(lines[2]), **record})
    (run / "rank-0.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(ProfileFormatError, match=r"rank-0.jsonl:3: .*" + message.replace("[", r"\[")):
        load_run(run)


def test_one_malformed_run_never_takes_down_the_others(tmp_path: Path, monkeypatch) -> None:
    from dashboard import data
    from dashboard.pages import VIEWS

    parent = tmp_path / "runs"
    write_run(parent / "a-good")
    bad_record = write_run(parent / "b-roles-list")
    lines = (bad_record / "rank-0.jsonl").read_text().splitlines()
    lines[1] = json.dumps({**json.loads(lines[1]), "roles": ["param_full"]})
    (bad_record / "rank-0.jsonl").write_text("\n".join(lines) + "\n")
    _set_header(write_run(parent / "c-model-string"), model="gpt2")
    loaded = [data.load(p) for p in sorted(parent.iterdir())]
    assert loaded[0].error is None and loaded[1].error and loaded[2].error
    for view in VIEWS:
        app = run_page([parent], view, monkeypatch)
        errors = " ".join(e.value for e in app.error)
        assert "b-roles-list" in errors and "c-model-string" in errors
        assert app.get("plotly_chart"), view  # the good run (or the estimator) still shows
