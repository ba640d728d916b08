"""The GPU validation command's CPU-possible parts (docs/gpu.md), so it cannot rot between GPU runs.

``python -m hfzero.testing.gpu_check --device cpu --quick`` runs every section's code on CPU / gloo with
tiny sizes: the world-1 matrix (12 of its 48 cases) against plain AdamW, 2 gloo ranks (parity, prefetch
trace, host syncs charged to their owners by the CPU census), the fake-world memory check (each stage in its
own process, stage 3 gathering every step with its unit buffers empty after it, the engine freed), a Trainer script under ``hfzero run
--zero_profile_dir`` with the dashboard rendering its profile, and the step-time table (each system in its
own process); the CUDA-only section skips with its reason. The runner records a section that fails, hangs
past its limit, cannot start before the run's deadline or does not exist, writes every check to
results.jsonl as it is recorded, and leaves at most 8 files.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hfzero.testing.gpu_check import runner
from hfzero.testing.gpu_check.common import Checks, Options, SectionSpec
from hfzero.testing.gpu_check.report import environment, write_json, write_markdown

CPU_SECTIONS = {"matrix", "shared_device", "fake_memory", "trainer_profile", "step_time"}


def _events(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_quick_cpu_run_passes_every_cpu_section(tmp_path: Path) -> None:
    out = tmp_path / "check"
    proc = subprocess.run([sys.executable, "-m", "hfzero.testing.gpu_check", "--device", "cpu", "--quick",
                           "--out", str(out)], capture_output=True, text=True, timeout=3600)
    report = json.loads((out / "gpu_check.json").read_text())
    status = {s["name"]: s for s in report["sections"]}
    failed = {n: (s["error"], [c for c in s["checks"] if not c["ok"]]) for n, s in status.items() if s["status"] == "fail"}
    assert proc.returncode == 0 and not failed, (failed, proc.stderr[-2000:])
    assert status["cuda_tests"]["status"] == "skip" and "needs CUDA" in status["cuda_tests"]["error"]
    for name in CPU_SECTIONS:
        assert status[name]["status"] == "pass" and status[name]["checks"], name
    assert len(status["matrix"]["checks"]) == 12  # every stage with each dtype, offload and accumulation mixed
    names = {name: [c["name"] for c in status[name]["checks"]] for name in status}
    assert status["fake_memory"]["figures"]["summary"]["stage 3"]["num_params"] > 0
    assert sum("the engine is freed" in n for n in names["fake_memory"]) == 3
    assert any("every step gathers and the unit buffers" in n for n in names["fake_memory"])
    assert status["fake_memory"]["figures"]["summary"]["stage 3"]["gathers_per_step"] > 0
    syncs = status["shared_device"]["figures"]["host_syncs"]
    assert set(syncs) == {"stage3-acc1", "stage3-acc2"}
    assert syncs["stage3-acc2"]["by_owner_per_step"].get("transformers", 0) >= 2  # the model's, charged to it
    assert sum(n.startswith("host syncs") for n in names["shared_device"]) == 3
    medians = status["step_time"]["figures"]["summary"]["median"]
    assert set(medians) == {"plain", "trainer_recipe", "fsdp2", "zero0", "zero1", "zero2", "zero3"}
    assert all("ms" in row for row in medians.values())
    markdown = (out / "gpu_check.md").read_text()
    assert all(f"## {name}: " in markdown for name in status)
    files = [p for p in out.rglob("*") if p.is_file()]
    assert len(files) <= 8, files
    events = _events(out)
    assert [e["name"] for e in events if e["event"] == "section"] == [n for n in status]
    checks = [e for e in events if e["event"] == "check"]
    assert len(checks) == sum(len(s["checks"]) for s in status.values())  # each written as it was recorded
    assert "===== matrix: pass" in (out / "logs.txt").read_text()


@pytest.mark.slow
def test_failures_and_time_outs_are_recorded_and_the_run_goes_on(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    sections = (SectionSpec("no_such_section", 120, 120, "a module that does not exist"),
                SectionSpec("matrix", 1, 1, "cannot finish in one second"))
    monkeypatch.setattr(runner, "SECTIONS", sections)
    options = Options(device="cpu", quick=True, out=str(tmp_path))
    results = runner.run_all(options, lanes=2)
    assert [r.name for r in results] == ["no_such_section", "matrix"]
    assert results[0].status == "fail" and "ModuleNotFoundError" in results[0].error
    assert results[1].status == "fail" and results[1].error.startswith("timed out after 1 s")
    with pytest.raises(ValueError, match="unknown section"):
        runner.run_all(options, ["nope"])
    assert json.loads((tmp_path / "gpu_check.json").read_text())["passed"] is False  # written by the run
    assert "timed out after 1 s" in (tmp_path / "gpu_check.md").read_text()
    assert [e["status"] for e in _events(tmp_path) if e["event"] == "section"] == ["fail", "fail"]
    logs = (tmp_path / "logs.txt").read_text()
    assert "===== no_such_section: fail" in logs and "ModuleNotFoundError" in logs and "===== matrix: fail" in logs
    assert not list(tmp_path.glob("running-*.log"))
    write_json(tmp_path / "r.json", options, results, environment())
    write_markdown(tmp_path / "r.md", options, results, environment())


def test_sections_past_the_deadline_are_recorded_as_not_run(tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """No process starts: the deadline has passed before the first section (the check is on the record)."""
    monkeypatch.setattr(runner, "SECTIONS", (SectionSpec("matrix", 60, 60, "x"),
                                             SectionSpec("step_time", 60, 60, "y", alone=True)))
    results = runner.run_all(Options(device="cpu", quick=True, out=str(tmp_path)), deadline_s=1e-3)
    assert [(r.name, r.status) for r in results] == [("matrix", "fail"), ("step_time", "fail")]
    assert all(r.error.startswith("not run: the run's 0 s deadline passed") for r in results)
    events = _events(tmp_path)
    assert events[0]["event"] == "start" and events[0]["deadline_s"] == 1e-3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpu_check.json", "gpu_check.md", "logs.txt",
                                                         "results.jsonl"]


def test_checks_are_written_as_they_are_recorded(tmp_path: Path) -> None:
    checks = Checks(str(tmp_path), "demo")
    checks.add("first", True, "fine")
    checks.figure("row", {"ms": 1.5})
    assert [e["event"] for e in _events(tmp_path)] == ["check", "figure"]  # before the section ends
    checks.add("second", False)
    assert not checks.ok and _events(tmp_path)[-1] == {"event": "check", "section": "demo", "name": "second",
                                                        "ok": False, "detail": ""}


def test_cuda_tests_collect_only_the_marked_files() -> None:
    from hfzero.testing.gpu_check.cuda_tests import marked_files

    names = [p.name for p in marked_files(Path(__file__).parent)]
    assert {"test_streams_cuda.py", "test_alignment.py", "test_host_syncs.py"} <= set(names)
    assert "test_stage3.py" not in names and len(names) < 10, names


@pytest.mark.slow
def test_a_crashing_step_time_system_loses_only_its_row(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from hfzero.testing.gpu_check import step_time

    monkeypatch.setattr(step_time, "SYSTEMS", ("zeroX", "zero1"))  # "zeroX": its process raises
    checks = Checks()
    figures = step_time.run(Options(device="cpu", quick=True, out=str(tmp_path)), checks)
    assert [(c["name"], c["ok"]) for c in checks.items] == [("zeroX ran", False), ("zero1 ran", True)]
    median = figures["summary"]["median"]
    assert "ValueError" in median["zeroX"]["error"] and median["zero1"]["ms"] > 0


def test_matrix_comparison_fails_on_drift_skips_and_placement() -> None:
    """The matrix's verdict can fail: a parameter or loss off by more than its derived bound (fp32) or the
    16-bit tolerance, a skipped step, or an offload that did not happen each fail the case (no spawn: the
    comparison alone, against a hand-made float64 reference whose bounds are 1e-5 everywhere)."""
    from hfzero.testing.gpu_check.matrix import Case, compare
    from hfzero.testing.parity import AdamRoundingBound, ParityReference

    ref = {"losses": [2.0, 1.9], "params": {"w": torch.zeros(3)}}
    bound = AdamRoundingBound(3, 1e-3)
    bound.bound.fill_(1e-5)
    ref64 = ParityReference([2.0, 1.9], [], [1e-5, 1e-5], [], torch.zeros(3, dtype=torch.float64), bound,
                            [("w", 0, 3)])
    good = {"losses": [2.0, 1.9], "params": {"w": torch.full((3,), 5e-6)}, "skipped": 0, "offloaded": True}
    case = Case(2, "fp32", True, 1)
    ok, detail = compare(case, good, ref, ref64)
    assert ok and "0.50" in detail  # the share of the bound used is reported
    off, detail = compare(case, {**good, "params": {"w": torch.tensor([0.0, 2e-5, 0.0])}}, ref, ref64)
    assert not off and "2.00 (of losses and parameters: w[1])" in detail  # which quantity used the most
    off, detail = compare(case, {**good, "losses": [2.0, 1.9001]}, ref, ref64)
    assert not off and "loss step 1" in detail
    assert not compare(case, {**good, "skipped": 1}, ref, ref64)[0]
    assert not compare(case, {**good, "offloaded": False}, ref, ref64)[0]
    assert compare(Case(2, "bf16", True, 1), {**good, "params": {"w": torch.full((3,), 1e-2)}}, ref, ref64)[0]
    assert not compare(Case(2, "bf16", True, 1), {**good, "losses": [2.1, 1.9]}, ref, ref64)[0]
    assert not compare(case, {"error": "RuntimeError: boom"}, ref, ref64)[0]
